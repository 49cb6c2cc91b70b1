"""Campaign config validation before any work: every error at once, each naming its key.

validate_campaign runs, in order: the command line's overrides read by the schema's types (typed), the schema
(jsonschema's iter_errors, defaults filled in as snakemake.utils.validate fills them; an unknown key gets a "did you
mean"), the model (checkpoint.base merged with checkpoint.config, which must then be complete), what the schema
cannot say (check_inputs) and the size estimate (workflow/plan/estimate.py).
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, validators
from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config

from evident.workflow.core.evidence import sha256_bytes
from evident.workflow.core.layout import MANIFEST
from evident.workflow.core.privacy import redact_env, redact_path, redact_words
from evident.workflow.models import checkpoints, families
from evident.workflow.plan import environment, estimate, recipes, runs, screens, targets

MODELS = Path(__file__).resolve().parents[2] / "config/models"  # checkpoint.base: <name>.yaml
OPTIONAL = {"rope_scaling"}  # of the tiny model's fields: absent means plain RoPE
# A stage that needs another's output brings it (the `stages:` key).
NEEDS = {"parity": "oracle", "serve_bench": "bench"}  # the HTTP bench stands beside the in-process one
# An old key read as its new name, with a warning: a campaign file written for an earlier version still runs.
RENAMED = {"nsight": "profile"}
# The schema's types other than string, each as YAML reads a scalar (bool is an int to Python, not to the schema).
SCALARS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
           "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
           "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None}


def models() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.yaml"))


def model_config(name: str) -> dict:
    return yaml.safe_load((MODELS / f"{name}.yaml").read_text())


def required_fields(model_type: str | None = None) -> list[str]:
    """What a complete checkpoint.config states: the fields of the family's tiny model (families.Family.tiny) but
    OPTIONAL. An unknown model_type is the schema's to refuse: here it reads as the default's."""
    family = families.FAMILIES.get(model_type) or families.of({})
    return sorted(set(model_config(family.tiny)) - OPTIONAL)


def report(problems: list[tuple[str, str]]) -> str:
    lines = [f"invalid campaign config at `{where}`: {what}" + ("" if what[-1:] in ".?!" else ".")
             for where, what in problems]
    count = f"{len(problems)} errors. " if len(problems) > 1 else ""
    return "\n".join(lines) + f"\n{count}See config/schema.yaml and docs/campaigns.md."


def did_you_mean(name, candidates, listing: bool = False) -> str:
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=3, cutoff=0.6)
    if close:
        return f"; did you mean {' or '.join(map(repr, close))}?"
    return f"; the keys here: {', '.join(map(str, candidates))}" if listing else ""


def validate_campaign(config: dict, schema: str, overrides: Mapping | None = None) -> None:
    """Validate, fill defaults and resolve the campaign in place (checkpoint.base merged into checkpoint.config;
    quality.gsm8k's null limit, shots and max_tokens fitted); raise one WorkflowError listing every problem.
    `overrides`: Snakemake's --config values, already merged into config, whose nested scalars it read as strings."""
    if overrides:
        update_config(config, typed(overrides, yaml.safe_load(Path(schema).read_text())))
    problems = renamed_keys(config)
    spec = config.get("checkpoint")
    if isinstance(spec, dict) and spec.get("source") == "trained":
        spec.setdefault("train", {})  # so that the schema fills its defaults in, for this source only
    problems += schema_problems(config, schema)
    own = own_directory(config, Path(schema).resolve().parents[1])
    if not problems:  # the checks below rely on the schema's types and defaults
        resolve_stages(config)
        model = resolve_model(config, problems)
        problems += recipes.problems(config)
        if model is not None:
            recipes.expand(config, model)
        problems += check_inputs(config, model)
        problems += estimate.size_problems(config, model)
        problems += check_baseline(config, own)
    if not problems and not own_sealed(config, own):  # nothing runs: nothing to reach
        problems += targets.reach_problems(config)
    if problems:
        raise WorkflowError(report(problems))


def resolve_stages(config: dict) -> None:
    """`stages` with what the chosen stages need, in the pipeline's order."""
    chosen = set(config["stages"]) | {NEEDS[s] for s in config["stages"] if s in NEEDS}
    config["stages"] = [s for s in runs.STAGES if s in chosen]


def typed(value, schema: dict):
    """A --config override as a campaign file gives it: Snakemake reads the scalars of a nested value as strings
    (`overlap={inputs: 8}` arrives as {'inputs': '8'}), so a string becomes what YAML reads it as where the schema
    takes that type at its key (integer, number, boolean, null; through properties, items and oneOf/anyOf). Anything
    else is left as given, for the schema to refuse (as a campaign file's own '8' is)."""
    alts = [schema, *schema.get("oneOf", []), *schema.get("anyOf", [])]
    if isinstance(value, Mapping):
        props = {k: s for a in alts for k, s in a.get("properties", {}).items()}
        more = next((a["additionalProperties"] for a in alts if isinstance(a.get("additionalProperties"), dict)), {})
        return {k: typed(v, props.get(k, more)) for k, v in value.items()}
    if isinstance(value, list):
        items = next((a["items"] for a in alts if isinstance(a.get("items"), dict)), {})
        return [typed(v, items) for v in value]
    if isinstance(value, str):
        types = {t for a in alts for t in ([a["type"]] if isinstance(a.get("type"), str) else a.get("type", []))}
        try:
            read = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if any(SCALARS[t](read) for t in types & SCALARS.keys()):
            return read
    return value


def renamed_keys(config: dict) -> list[tuple[str, str]]:
    """Move each old top-level key to its new name, warning once; both given is an error (which one is meant?)."""
    problems = []
    for old, new in RENAMED.items():
        if old not in config:
            continue
        if new in config:
            problems.append((old, f"is the old name of `{new}`, which is given too; keep `{new}` only"))
            continue
        config[new] = config.pop(old)
        print(f"evident: campaign key `{old}` is now `{new}`; it was read as `{new}` (rename it in the campaign file)",
              file=sys.stderr)
    return problems


def _where(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def _filling(cls):
    """The validator class that fills in each property's default before validating it (jsonschema's FAQ recipe,
    as snakemake.utils.validate uses it)."""
    validate_properties = cls.VALIDATORS["properties"]

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, props, instance, schema)

    return validators.extend(cls, {"properties": properties})


def schema_problems(config: dict, schema: str) -> list[tuple[str, str]]:
    """Every schema error (an unknown key: one each, with the closest names), then unknown checkpoint.config fields:
    transformers would accept a misspelt field silently and build its default instead."""
    validator = _filling(Draft202012Validator)(yaml.safe_load(Path(schema).read_text()))
    out = []
    for e in validator.iter_errors(config):
        where = _where(e.absolute_path)
        if e.validator == "additionalProperties" and isinstance(e.instance, dict):
            known = list(e.schema.get("properties", {}))
            out += [(where, f"{k!r} was unexpected{did_you_mean(k, known, listing=True)}") for k in e.instance
                    if k not in known]
        elif list(e.relative_schema_path)[:1] == ["then"]:  # the schema's one conditional: cases for oracle, parity
            out.append((where, f"{e.message}: the oracle and parity stages follow the cases' prompts (a campaign "
                               "whose `stages` leave both out needs none)"))
        else:
            out.append((where, e.message))
    spec = config.get("checkpoint") if isinstance(config.get("checkpoint"), dict) else {}
    model = spec.get("config")
    if isinstance(model, dict):
        known = family_keys(model, spec.get("base"))
        out += [("checkpoint.config", f"unknown DeepSeek config field {k!r}{did_you_mean(k, sorted(known))}")
                for k in sorted(set(model) - known, key=str)]
    return out


def family_keys(model: dict, base=None) -> set:
    """The fields a checkpoint.config may state: its family's (families.Family.keys), by its model_type, given or
    the base's. An unknown model_type is the schema's to refuse: here it reads as the default's."""
    kind = model.get("model_type")
    if kind is None and isinstance(base, str) and base in models():
        kind = model_config(base).get("model_type")
    return (families.FAMILIES.get(kind) or families.of({})).keys


def resolve_model(config: dict, problems: list) -> dict | None:
    """A synthetic or trained campaign's model config: checkpoint.base's fields overridden by checkpoint.config,
    written back as checkpoint.config (base is dropped: the evidence records and hashes the merged config, so a
    campaign with a base and one written out in full are the same). None when there is none or it is refused."""
    spec = config["checkpoint"]
    base = spec.pop("base", None)
    if "train" in spec and spec["source"] != "trained":
        problems.append(("checkpoint.train", f"only for source trained, not {spec['source']}"))
    if spec["source"] not in checkpoints.WRITTEN:
        if base is not None or spec["config"]:
            problems.append(("checkpoint.base" if base is not None else "checkpoint.config",
                             f"only for source synthetic or trained: a {spec['source']} checkpoint brings its own "
                             "config.json"))
        return None
    if base is not None:
        if base not in models():
            problems.append(("checkpoint.base", f"no shipped model {base!r}{did_you_mean(base, models())} "
                             f"(config/models/ has {', '.join(models())})"))
            return None
        spec["config"] = {**model_config(base), **spec["config"]}
    missing = [f for f in required_fields(spec["config"].get("model_type")) if f not in spec["config"]]
    if missing and not spec["config"]:
        problems.append(("checkpoint", f"no model: set checkpoint.base ({', '.join(models())}) or give "
                                       "checkpoint.config in full"))
        return None
    if missing:
        try:
            size = f" (here: {estimate.count(estimate.parameters(spec['config']))} parameters)"
        except Exception:  # noqa: BLE001 - transformers' defaults may not even make a model
            size = ""
        problems.append(("checkpoint.config", f"missing field(s) {', '.join(missing)}: transformers would take its "
                         f"defaults for them{size}; give every field, or set checkpoint.base "
                         f"({', '.join(models())}) and keep checkpoint.config for the fields that differ"))
        return None
    try:
        families.of(spec["config"]).args(spec["config"])  # the engine's reading of the family's config
    except Exception as e:  # noqa: BLE001 - the engine's own check of the fields, whatever it raises
        problems.append(("checkpoint.config", str(e) or type(e).__name__))
        return None
    return spec["config"]


def _strings(node, where: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k, where or "<top level>")
            yield from _strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{where}.{i}")
    elif isinstance(node, str):
        yield where, node


def triton_problems(config: dict) -> list[tuple[str, str]]:
    """The engine's Triton paths asked for where Triton is not installed (macOS)."""
    why = environment.triton_missing()
    stages = set(config["stages"])
    asked = [("parity.kernels", k) for k in config["parity"]["kernels"] if "parity" in stages and k != "torch"]
    if {"bench", "profile"} & stages and config["bench"]["kernels"] != "torch":
        asked.append(("bench.kernels", config["bench"]["kernels"]))
    return [(key, f"{path}: {why}") for key, path in asked] if why else []


def check_inputs(config: dict, model: dict | None = None) -> list[tuple[str, str]]:
    """What the schema cannot say, as (key, message), checked before any work (tests/reliability/test_bad_input.py).

    Text must be valid UTF-8 (YAML's `\\udc80` escape gives a lone surrogate that no file can hold), prompts must
    not be blank, a local checkpoint must be a folder with a config.json (`local_problems`), and each prompt must fit
    the model's context with its new tokens: counted with the tokenizer where it exists before any work (synthetic,
    local; a hub checkpoint's record counts them), else at least fewer new tokens than the context. The quality
    defaults are fitted and checked (estimate.fit_quality), the reference must be a target, each of `screens` must
    name a factory that imports (workflow/plan/screens.py `problems`), expert-parallel ranks must divide the experts, what
    the engine cannot run on the model is refused (its family's `problems`), and `device: cuda` needs a GPU here
    (set EVIDENT_SKIP_DEVICE_CHECK=1 on a submit host without one, whose jobs run elsewhere).
    """
    out = []
    for where, text in _strings(config):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            out.append((where, f"not valid UTF-8 text ({e.reason} at character {e.start})"))
    if out:
        return out
    out += [(f"cases.{i}.prompt", "the prompt is blank") for i, c in enumerate(config.get("cases", [])) if not c["prompt"].strip()]
    bench = config["bench"]
    if not bench["prompt"].strip():
        out.append(("bench.prompt", "the prompt is blank"))
    prompts = bench.get("prompts") or []
    out += local_problems(config["checkpoint"])
    out += [(f"bench.prompts.{i}", "the prompt is blank") for i, p in enumerate(prompts) if not p.strip()]
    if prompts and len(prompts) < max(bench["batch_sizes"]):
        out.append(("bench.prompts", f"{len(prompts)} prompts for batch sizes up to {max(bench['batch_sizes'])}: row r "
                                     "of a batch gets prompts[r] (never cycled, which would repeat rows); give at least "
                                     f"{max(bench['batch_sizes'])} different prompts, or smaller bench.batch_sizes"))
    try:
        context, tok = estimate.model_files(config, model)
    except ValueError as e:  # checkpoints.CheckpointInvalid: ids the byte-level tokenizer cannot have
        return out + [("checkpoint.config", str(e))]
    if context is not None:
        out += [(f"cases.{i}.max_new_tokens", f"{c['max_new_tokens']} new tokens do not fit the model's context of "
                 f"{context} (max_position_embeddings) beside a prompt")
                for i, c in enumerate(config.get("cases", [])) if c["max_new_tokens"] >= context]
    train = config["checkpoint"].get("train")
    if train and context is not None and train["seq_len"] > context:
        out.append(("checkpoint.train.seq_len", f"{train['seq_len']} tokens a row exceed the model's context of "
                                                f"{context} (max_position_embeddings)"))
    if tok is not None and context is not None and not out:
        from evident.workflow.models.checkpoints import prompt_problems

        out += [(key, what) for key, _, what in prompt_problems(tok, context, config)]
    out += estimate.fit_quality(config, context, tok)
    q = config["quality"]
    names = [t if isinstance(t, str) else t["name"] for t in q["targets"]]
    if q["reference"] not in names:
        out.append(("quality.reference", f"{q['reference']!r} is not one of quality.targets {names}"))
    if len(set(names)) < len(names):
        out.append(("quality.targets", f"a target name appears twice: {names}"))
    out += targets.problems(config)
    out += targets.bench_problems(config)
    out += load_problems(config)
    engines = targets.by_name(config)
    for i, t in enumerate(q["targets"]):
        if isinstance(t, str) and t not in ("hf", "engine") and engines.get(t, {}).get("kind") != "openai":
            out.append((f"quality.targets.{i}", f"{t!r} is neither hf, engine nor an `engines:` entry of kind openai"
                        + (" (a command target runs parity only)" if t in engines else
                           did_you_mean(t, ["hf", "engine", *engines]))))
        elif isinstance(t, dict) and t["name"] in engines:
            out.append((f"quality.targets.{i}.name", f"{t['name']!r} is an `engines:` entry's name too; name the entry "
                                                      "alone (its url or serve command is used)"))
    out += triton_problems(config)
    o = config["overlap"]
    stated = [k for k in ("K", "segments", "gemm_n") if o[k] is not None]
    if stated and len(stated) < 3:
        out.append(("overlap", f"states {', '.join(stated)} but not all of K, segments and gemm_n: the screen's "
                               "shapes are stated together or taken from the model"))
    if o["segments"] is not None and len(o["segments"]) != len(o["segment_dtypes"]):
        out.append(("overlap.segment_dtypes", "needs one dtype per overlap.segments entry"))
    out += screens.problems(config)
    experts, ep = (model or {}).get("n_routed_experts"), config["parallel"]["ep_size"]
    if experts and set(runs.EP_BACKENDS) & set(config["parity"]["backends"] + config["bench"]["backends"]) and experts % ep:
        out.append(("parallel.ep_size", f"{ep} ranks do not divide the model's {experts} routed experts "
                                        "(checkpoint.config.n_routed_experts)"))
    family = model_family(config, model)
    if family is not None:
        out += family.problems(config)
    if config["device"] == "cuda" and not os.environ.get("EVIDENT_SKIP_DEVICE_CHECK"):
        import torch  # only a cuda campaign pays for the import

        if not torch.cuda.is_available():
            out.append(("device", "cuda was requested but no CUDA GPU is visible here; use device: cpu or auto"))
    return out


MIN_SOAK_REQUESTS = 9  # expected over a soak: its two latency windows are a third of it each, three requests or more


def load_problems(config: dict) -> list[tuple[str, str]]:
    """The rate rung and the soak before any work: an SLO with no rate to apply it to, soak targets that take no HTTP
    requests, a soak too short or too sparse to compare its windows, and sending that outlasts a job's wall time
    (resources.runtime)."""
    http, soak, out = config["bench"]["http"], config["soak"], []
    stages, limit_s = set(config["stages"]), config["resources"]["runtime"] * 60
    if http["slo"] is not None and not http["rates"]:
        out.append(("bench.http.slo", "goodput is the rate rung's: give bench.http.rates (requests a second) too"))
    labels = [runs.rate_cell("t", r) for r in http["rates"]]
    if len(set(labels)) < len(labels):
        out.append(("bench.http.rates", f"{http['rates']}: two rates write one cell (its name keeps 6 digits)"))
    if "serve_bench" in stages and http["rates"]:
        sending = sum(http["requests"] / r for r in http["rates"])  # the arrivals' expected span, a target
        if sending > limit_s:
            out.append(("bench.http.rates", f"{http['requests']} requests at each of {http['rates']} requests/s take "
                                            f"about {sending:.0f} s to send, beyond a job's wall time "
                                            f"(resources.runtime {config['resources']['runtime']} min): fewer "
                                            "bench.http.requests or higher rates"))
    if "soak" not in stages:
        return out
    engines = targets.by_name(config)
    for i, t in enumerate(soak["targets"] or []):
        if t != targets.ENGINE and engines.get(t, {}).get("kind") != "openai":
            out.append((f"soak.targets.{i}", f"{t!r} is neither {targets.ENGINE} (the builtin engine's server) nor an "
                                             "`engines:` entry of kind openai"
                        + (" (a command target takes no HTTP requests)" if t in engines else
                           did_you_mean(t, [targets.ENGINE, *engines]))))
    if (expected := soak["rate"] * soak["duration_s"]) < MIN_SOAK_REQUESTS:
        out.append(("soak", f"{soak['rate']:g} requests/s for {soak['duration_s']:g} s expect {expected:.1f} requests: "
                            f"its latency windows need {MIN_SOAK_REQUESTS} at least; raise soak.rate or "
                            "soak.duration_s"))
    if (total := soak["duration_s"] * len(targets.soak_targets(config))) > limit_s:
        out.append(("soak.duration_s", f"{len(targets.soak_targets(config))} target(s) soaked one after another for "
                                       f"{soak['duration_s']:g} s each take {total:g} s, beyond a job's wall time "
                                       f"(resources.runtime {config['resources']['runtime']} min): raise "
                                       "resources.runtime or shorten the soak"))
    return out


def local_problems(spec: dict) -> list[tuple[str, str]]:
    """checkpoint.path must be a folder with a config.json now: else Snakemake stops at record_checkpoint's missing
    input, naming the file but not the key (the weights and their hashes the checkpoint record checks, as a hub
    download's)."""
    if spec["source"] != "local":
        return []
    path = Path(spec["path"])
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    if not path.exists():
        what = "does not exist"
    elif not (path / "config.json").is_file():
        what = "is not a folder with a config.json" if path.is_dir() else "is a file, not a folder"
    else:
        return []
    return [("checkpoint.path", f"{spec['path']}{where} {what}: give an existing Hugging Face-format checkpoint "
                                "folder (config.json, its tokenizer and *.safetensors weights)")]


def model_family(config: dict, model: dict | None) -> families.Family | None:
    """The campaign's model family before any work: a written model's config's (families.model_type),
    a local checkpoint's config.json's; None for a hub checkpoint (its config comes with the download) or an
    unreadable or unknown one (the checkpoint record names what is wrong)."""
    spec = config["checkpoint"]
    try:
        if model is not None:
            return families.of(model)
        if spec["source"] == "local":
            return families.of_checkpoint(spec["path"])
    except Exception:  # noqa: BLE001 - absent, damaged or unknown: the checkpoint record says so
        return None
    return None


def own_directory(config: dict, code_dir: Path) -> Callable[[], Path | None]:
    """The run's own evidence directory, its id derived as common.smk derives it (None while its campaign has none),
    as a call that derives it once, where a check first asks (a git call, and the hash of the user's screens)."""
    from evident.workflow.archive import archive
    from evident.workflow.core.evidence import evidence_id, git_state

    @functools.cache
    def own() -> Path | None:
        home = archive.ROOT / config["campaign"]
        return home / evidence_id(git_state(code_dir), evidence_config(config), config["repeat"]) if home.is_dir() else None

    return own


def own_sealed(config: dict, own: Callable[[], Path | None]) -> bool:
    """Whether the run's own directory is sealed (then nothing runs and the gate only reads it). Asked only where it
    matters: a campaign with an engine target's URL (a git call)."""
    if not any("url" in e for e in config.get("engines", [])):
        return False
    own = own()
    return own is not None and (own / MANIFEST).is_file()


def check_baseline(config: dict, own: Callable[[], Path | None]) -> list[tuple[str, str]]:
    """bench.baseline must name a sealed directory now, resolved as the bench_report stage resolves it (which leaves
    out the run's own directory: its id is derived here as common.smk derives it)."""
    ref = config["bench"]["baseline"]
    if not ref:
        return []
    from evident.workflow.archive import archive

    home, own = archive.ROOT / config["campaign"], own()
    if own is not None and (own / MANIFEST).is_file():
        return []  # sealed: nothing runs, the gate only reads it
    try:
        archive.resolve(ref, archive.ROOT, campaign=config["campaign"], exclude=own, sealed=True)
    except (archive.NotFound, OSError, ValueError) as e:
        if home.is_dir() or "/" in ref or "@" in ref:
            return [("bench.baseline", str(e))]
        return [("bench.baseline", f"no evidence directory matches {ref!r}: campaign {config['campaign']} has none "
                                   f"under {home.as_posix()}/ here yet (a path names another campaign's)")]
    return []


class CampaignFileError(ValueError):
    pass


def read_campaign_file(path: str) -> dict:
    """A campaign file as YAML, or an error naming the file, the line and the fix.

    Snakemake reads `--configfile` itself, before the Snakefile, and answers a bad byte with a traceback;
    `evident run` calls this first so the user reads one line instead.
    """
    import yaml

    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise CampaignFileError(f"campaign file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CampaignFileError(f"campaign file {path} is not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}, "
                                f"column {column}; save it as UTF-8") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise CampaignFileError(f"campaign file {path} is not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
    if not isinstance(config, dict):
        raise CampaignFileError(f"campaign file {path} must hold a mapping of keys (campaign:, cases:, ...), "
                                f"not {type(config).__name__}")
    return config


def evidence_config(config: dict) -> dict:
    """The config as recorded in evidence and hashed into the id.

    `tracking` and `resources` are left out (where runs are logged and what jobs asked a scheduler for are
    not part of what was measured, and a URL may carry a host or credentials); file system paths are redacted.
    Each of `screens` gets the `source_sha256` of the user's code it runs (None where it does not import: the
    campaign check says why).
    """
    out = copy.deepcopy({k: v for k, v in config.items() if k not in ("tracking", "resources")})
    if out["checkpoint"].get("path"):
        out["checkpoint"]["path"] = redact_path(out["checkpoint"]["path"])
    baseline = out.get("bench", {}).get("baseline")
    if baseline and ("/" in baseline or os.sep in baseline):
        out["bench"]["baseline"] = redact_path(baseline)
    gsm = out.get("quality", {}).get("gsm8k", {})
    for split in ("test", "train"):  # data files: the name and a hash of the path; the stage records their sha256
        if gsm.get(split):
            gsm[split] = redact_path(gsm[split])
    for t in [*out.get("quality", {}).get("targets", []), *out.get("engines", [])]:
        if isinstance(t, dict) and t.get("url"):  # an endpoint URL may carry a host or credentials
            t["url"] = f"<url>#{sha256_bytes(t['url'].encode())[:8]}"
    for e in out.get("screens") or []:  # the user's code is what a screen measures, as the project's own is
        e["source_sha256"] = screens.source_sha256(e["module"])
    for e in out.get("engines", []):  # commands are recorded, each absolute path as its last part and a hash
        for node, key in ((e, "command"), (e.get("serve") or {}, "command")):
            if node.get(key):
                node[key] = _redact_command(node[key])
        if e.get("python"):
            e["python"] = redact_words([e["python"]])[0]
        e["args"] = redact_words(e.get("args", []))
        if e.get("env"):
            e["env"] = redact_env(e["env"])
    return out


def _redact_command(template: str) -> str:
    import shlex

    try:
        words = shlex.split(template)
    except ValueError:  # refused by the campaign check; recorded as a hash meanwhile
        return f"<command>#{sha256_bytes(template.encode())[:8]}"
    return " ".join(redact_words(words))  # a record, never run
