"""The model: observations joined into budgets, summaries, peaks; the metric catalogue."""
