"""Callers: who may call (config, identity), under which quotas (limits), at which priority."""
