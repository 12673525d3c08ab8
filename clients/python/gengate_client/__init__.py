"""Typed Python client for the gengate gRPC service."""
