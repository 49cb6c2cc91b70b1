"""Campaign config validation with a short error that names the offending key."""

from __future__ import annotations

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate


def validate_campaign(config: dict, schema: str) -> None:
    """Validate and fill defaults (snakemake.utils.validate); re-raise naming the key and value."""
    try:
        validate(config, schema, set_default=True)
    except WorkflowError as e:
        cause = e.__context__  # the jsonschema ValidationError that snakemake wrapped
        if not hasattr(cause, "absolute_path"):
            raise
        where = ".".join(str(p) for p in cause.absolute_path) or "<top level>"
        raise WorkflowError(f"invalid campaign config at `{where}`: {cause.message}. "
                            f"See config/schema.yaml and the README's key table.") from None
