"""Durable batch jobs: a store that keeps every request and result (SQLite by default,
PostgreSQL for replicas sharing jobs) and a runner that works through queued jobs at a lower
priority than interactive calls, surviving restarts of the server."""
