"""evident's workflow package: the evidence core, MLflow tracking and the stage CLIs behind the rules."""
