"""shmwatch: a Prometheus exporter for the memory that kills LLM-serving pods."""

__version__ = "0.1.0"
