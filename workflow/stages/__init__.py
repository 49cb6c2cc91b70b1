"""One module per pipeline stage; each is a CLI (`python -m evident.workflow.stages.<stage>`) with a `main()`."""
