"""Reading the evidence: the archive, diff, prune, trend, the HTML pages, SUMMARY.md and the MLflow UI."""
