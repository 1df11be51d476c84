"""Traces, metrics, logs and health endpoints."""
