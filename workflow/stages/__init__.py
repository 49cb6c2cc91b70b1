"""One module per pipeline stage; each is a CLI (`python -m workflow.stages.<stage>`) with a `main()`."""
