"""Composite models: backends built from other configured models.

`fallback` tries its members in order; `mixture_of_agents` asks proposers and has an aggregator
synthesise their answers. A composite names its members in its options; the router hands it a
lookup (`bind`) once every backend is built, and starts it after its members, because its
capabilities derive from theirs.
"""
