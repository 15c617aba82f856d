"""`PipelineConfig`: one typed, validated config composed of the per-stage sections defined beside their code.

YAML files hold values only. `--set a.b.c=VALUE` overrides any field by its dotted path, VALUE parsed as
YAML. Validation happens before any work starts; an error names the field and the file.
Secrets never live here: credentials come from the environment (a config holding a URL with a password is refused).
`lifecycle config show | schema` (`register_config`, at the end) prints every field or the JSON Schema.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lifecycle.core.errors import UsageError
from lifecycle.core.fs import is_remote
from lifecycle.core.paths import DEFAULT_CONFIG, PathEscape, pattern_root, resolve_within  # DEFAULT_CONFIG: re-exported
from lifecycle.lineage.tracking import TrackingConfig
from lifecycle.tasks.data.collect.stage import CollectConfig
from lifecycle.tasks.data.decontaminate.stage import DecontaminateConfig
from lifecycle.tasks.data.dedup.stage import DedupConfig
from lifecycle.tasks.data.quality.stage import COLUMN as FASTTEXT_COLUMN, QualityConfig
from lifecycle.tasks.data.select.stage import SelectConfig
from lifecycle.tasks.eval.evaluate.stage import EvaluateConfig
from lifecycle.tasks.eval.perplexity.stage import COLUMN as PERPLEXITY_COLUMN, PerplexityConfig
from lifecycle.tasks.data.filter.stage import FilterConfig
from lifecycle.tasks.data.scrub.stage import ScrubConfig
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig
from lifecycle.tasks.clip.config import ClipEvalConfig, ClipTrainConfig
from lifecycle.tasks.data.images.collect.stage import ImageCollectConfig
from lifecycle.tasks.data.images.dedup.stage import ImageDedupConfig
from lifecycle.tasks.data.images.filter.stage import ImageFilterConfig
from lifecycle.tasks.data.images.preprocess.stage import ImagePreprocessConfig
from lifecycle.tasks.data.images.scrub.stage import ImageScrubConfig
from lifecycle.tasks.train.config import TrainConfig


class OrchestrationConfig(BaseModel):
    """How Prefect runs the stages."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    data_retries: int = Field(2, ge=0, description="Retries of a data stage that raised (not for bad config).")
    retry_backoff_s: float = Field(2.0, gt=0, description="First retry delay; each next retry doubles it.")
    retry_jitter: float = Field(0.5, ge=0, description="Random jitter factor added to each retry delay.")
    train_retries: int = Field(1, ge=0, description="Retries of the train stage; each resumes from the last commit.")
    stage_timeout_s: float | None = Field(
        3600, gt=0, description="Timeout of each stage attempt except train (a Prefect timeout cannot stop the "
        "DeepSpeed ranks: the train supervisor enforces `train.launch.timeout_s` itself); in collect, filter, dedup's "
        "signatures and scrub, of each shard attempt, whose process is killed at it. null = none.")
    shard_timeout_s: float | None = Field(
        600, gt=0, description="Watchdog of each shard of collect, filter, dedup and scrub: a shard runs in a forked "
        "process that is killed when it makes no progress (no record read, no file written) for this long; the "
        "shard then fails naming the stage and shard, and its retry (`data_retries`) or a rerun builds it again, "
        "finished shards kept. Costs one fork per shard (a few ms). null = shards run unwatched in the worker.")
    dask_workers: int = Field(
        default_factory=lambda: min(os.cpu_count() or 1, 4), ge=0,
        description="Local worker processes that run the shards of collect, filter, dedup's signatures and scrub "
        "(one shard each at a time; forked from a forkserver that imported the data stages). 0 = run shards one "
        "after another in the flow process. Ignored with `dask_address`. Default: cores, up to 4.")
    dedup_memory_limit: str = Field(
        "2GB", pattern=r"^\d+(\.\d+)?\s*[KMGT]i?B$", description="DuckDB memory limit of dedup's global half "
        "(exact copies, LSH buckets, clusters over the whole dataset); past it DuckDB spills to a scratch directory "
        "beside the dataset, so this, not the corpus size, bounds its memory. Changes no decision.")
    dask_address: str | None = Field(
        None, description="Address of a running Dask scheduler (tcp://host:8786): shards run on that cluster "
        "instead of local worker processes. Its workers need this package installed and the work dir at the same path.")


class PipelineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("lifecycle", description="Name of this pipeline (MLflow experiment default, Prefect run name).")
    workdir: str = Field("runs/demo", description="Where every dataset, checkpoint and the local MLflow store live.")
    input_roots: list[str] | None = Field(None, description=(
        "Directories the pipeline may read input from (relative ones from the current directory, like the input "
        "patterns), besides the work dir. When set, every `collect.inputs` pattern's fixed directory, "
        "`tokenize.tokenizer_file` and the directory of `train.init_from: hf:<dir>` must resolve (symlinks followed) inside one of them. null: each pattern's own "
        "fixed directory is its root. Either way, a file a pattern matches must resolve inside the pattern's "
        "fixed directory (lifecycle/core/paths.py)."))
    collect: CollectConfig = Field(description="Reading the raw input files (tasks/data/collect/stage.py).")
    filter: FilterConfig = Field(FilterConfig(), description="Quality and language rules, in order "
                                 "(tasks/data/filter/).")
    dedup: DedupConfig = Field(DedupConfig(), description="Exact and MinHash near-duplicate removal "
                               "(tasks/data/dedup/stage.py).")
    scrub: ScrubConfig = Field(ScrubConfig(), description="PII placeholders (tasks/data/scrub/stage.py).")
    decontaminate: DecontaminateConfig = Field(DecontaminateConfig(), description="Reject documents sharing an "
                                               "n-gram with an eval set; off by default "
                                               "(tasks/data/decontaminate/stage.py).")
    quality: QualityConfig = Field(QualityConfig(), description="Per-document quality scores (a fastText "
                                   "classifier), never dropping; off by default (tasks/data/quality/stage.py).")
    perplexity: PerplexityConfig = Field(PerplexityConfig(), description="Per-document perplexity under the "
                                         "registered champion model, never dropping; skipped while there is no "
                                         "champion; off by default (tasks/eval/perplexity/stage.py).")
    select: SelectConfig = Field(SelectConfig(), description="The keep rule on a score column, run with quality "
                                 "or perplexity (tasks/data/select/stage.py).")
    tokenize: TokenizeConfig = Field(TokenizeConfig(), description="BPE tokenizer and token shards "
                                     "(tasks/data/tokenize/stage.py).")
    train: TrainConfig = Field(TrainConfig(), description="Model, optimizer, DeepSpeed and checkpoints "
                               "(tasks/train/config.py).")
    evaluate: EvaluateConfig = Field(EvaluateConfig(), description="Held-out scores and the contamination gate "
                                     "(tasks/eval/evaluate/stage.py).")
    image_collect: ImageCollectConfig = Field(ImageCollectConfig(), description="The image-text path's inputs and "
                                              "decode-verify; `enabled` runs that path instead of the text one "
                                              "(tasks/data/images/).")
    image_filter: ImageFilterConfig = Field(ImageFilterConfig(), description="Image size, aspect and caption rules.")
    image_dedup: ImageDedupConfig = Field(ImageDedupConfig(), description="Exact (pixels) and near (pHash) image "
                                          "duplicates.")
    image_scrub: ImageScrubConfig = Field(ImageScrubConfig(), description="Image metadata, faces, caption PII.")
    image_preprocess: ImagePreprocessConfig = Field(ImagePreprocessConfig(), description="Training-size image "
                                                    "shards and caption tokens.")
    clip_train: ClipTrainConfig = Field(ClipTrainConfig(), description="The image path's dual encoder, trained "
                                        "under DeepSpeed ZeRO (tasks/clip/).")
    clip_evaluate: ClipEvalConfig = Field(ClipEvalConfig(), description="Zero-shot retrieval on held-out pairs.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow tracking and registry "
                                     "(lineage/tracking.py).")
    orchestration: OrchestrationConfig = Field(OrchestrationConfig(), description="How Prefect and Dask run the "
                                               "stages.")

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if v.startswith("file://"):
            v = v[len("file://"):]
        elif "://" in v:
            raise ValueError(f"{v}: the work dir must be a POSIX file system (local or shared, e.g. NFS), not an "
                             "object store: its commit protocol needs atomic rename, fsync and flock. Inputs may "
                             "be fsspec URLs (collect.inputs).")
        return str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _base_tokenizer(self) -> "PipelineConfig":
        """`train.init_from: hf:<dir>` tokenizes with the base model's tokenizer: `tokenize.base_model` is that
        directory (filled in here when unset)."""
        if not self.train.init_from.startswith("hf:"):
            if self.tokenize.base_model is not None:
                raise ValueError("tokenize.base_model is set but train.init_from is not hf:<dir>: the model would "
                                 "not match its tokenizer")
            return self
        base = str(Path(self.train.init_from[3:]).expanduser().resolve())
        if self.tokenize.base_model not in (None, base):
            raise ValueError(f"tokenize.base_model ({self.tokenize.base_model}) differs from train.init_from "
                             f"({self.train.init_from})")
        if self.tokenize.base_model is None:  # frozen model: set once, at validation
            object.__setattr__(self, "tokenize", self.tokenize.model_copy(update={"base_model": base}))
        return self

    @model_validator(mode="after")
    def _select_column(self) -> "PipelineConfig":
        """select reads a column that a scorer which is on writes."""
        writers = {FASTTEXT_COLUMN: "quality", PERPLEXITY_COLUMN: "perplexity"}
        on = [s for s in writers.values() if getattr(self, s).enabled]
        if on and writers.get(self.select.column) not in (None, *on):
            raise ValueError(f"select.column is {self.select.column}, written by {writers[self.select.column]}, "
                             f"which is off; the scorer on ({', '.join(on)}) writes "
                             f"{', '.join(c for c, s in writers.items() if s in on)}")
        return self

    @model_validator(mode="after")
    def _no_secrets(self) -> "PipelineConfig":
        """The config is logged to MLflow and Prefect: credentials must come from the environment instead."""
        for path, value in _strings(self.model_dump(mode="json")):
            if _CREDENTIAL_URL.search(value):
                raise ValueError(f"`{path}` holds a URL with a password; put credentials in the environment "
                                 "(e.g. MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), never in the config")
        return self


    @model_validator(mode="after")
    def _inputs(self) -> "PipelineConfig":
        """The text path needs input patterns; the image path reads image_collect.inputs instead."""
        if not self.collect.inputs and not self.image_collect.enabled:
            raise ValueError("field `collect.inputs`: at least one input pattern is required (or "
                             "image_collect.enabled with image_collect.inputs, for the image path)")
        return self

    @model_validator(mode="after")
    def _confined(self) -> "PipelineConfig":
        """Declared input roots: the inputs and the tokenizer file must lie inside them or the work dir."""
        if self.input_roots is None:
            return self
        roots = [*self.input_roots, self.workdir]
        named = [(f"collect.inputs[{i}]", p, pattern_root(p)) for i, p in enumerate(self.collect.inputs)]
        if self.tokenize.tokenizer_file is not None:
            named.append(("tokenize.tokenizer_file", self.tokenize.tokenizer_file, self.tokenize.tokenizer_file))
        if self.train.init_from.startswith("hf:"):  # the base model's directory is read as an input too
            named.append(("train.init_from", self.train.init_from, self.train.init_from[3:]))
        problems = []
        for field, value, path in named:
            try:
                if not is_remote(value):
                    resolve_within(path, roots, f"`{field}` ({value!r}) is not inside `input_roots` or the work dir")
            except PathEscape as e:
                problems.append(str(e))
        if problems:
            raise ValueError("\n  ".join(problems))
        return self


_CREDENTIAL_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@", re.I)


def _strings(obj, path: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(obj, str):
        yield path, obj


class ConfigError(UsageError, ValueError):
    """A config that cannot be loaded or does not validate; the message names the field."""


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: `{k}` is not a section")
        node = nxt
    node[keys[-1]] = value


def yaml_problem(e: yaml.YAMLError) -> str:
    """'line 2, column 5: expected ',' or ']', but got ':'' (PyYAML's own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else " ".join(problem.split())


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value is not valid YAML: {yaml_problem(e)}") from e


def format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        if not e["loc"]:  # a cross-field check: its message names the fields itself
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
            continue
        field = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"[:120]
        hint = ""
        if e["type"] == "extra_forbidden" and (close := closest_field(e["loc"])):
            hint = f"; did you mean `{close}`?"
        lines.append(f"  field `{field}`: {e['msg']}{shown}{hint}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# discovering the config: the sections and fields under a path, `lifecycle config show` and `schema`


def _sections(annotation) -> list[type[BaseModel]]:
    """The config classes a field holds (`FilterConfig`, `X | None`, a union of sections)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [c for a in typing.get_args(annotation) for c in _sections(a)]


def closest_field(loc: tuple) -> str | None:
    """The dotted name of the known field nearest to the unknown key at `loc` (difflib), or None."""
    classes: list[type[BaseModel]] = [PipelineConfig]
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        classes = [c for cls in classes if part in cls.model_fields
                   for c in _sections(cls.model_fields[part].annotation)]
    names = sorted({n for cls in classes for n in cls.model_fields})
    match = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return ".".join([*(str(p) for p in loc[:-1]), match[0]]) if match else None


def _default(field) -> Any:
    if field.is_required():
        return None
    return field.default_factory() if field.default_factory is not None else field.default


def config_fields(cfg: BaseModel | None = None, cls: type[BaseModel] = None, prefix: str = "") -> list[dict]:
    """Every leaf field of a config (or of the built-in defaults when `cfg` is None), in declaration order:
    {field (dotted), value, default, required, type, doc}."""
    from pydantic_core import to_jsonable_python

    cls = cls or (type(cfg) if cfg is not None else PipelineConfig)
    rows = []
    for name, f in cls.model_fields.items():
        default = _default(f)
        value = getattr(cfg, name) if cfg is not None else default
        sections = _sections(f.annotation)
        if isinstance(value, BaseModel) or (value is None and f.is_required() and len(sections) == 1):
            sub = value if isinstance(value, BaseModel) else None
            rows += config_fields(sub, type(sub) if sub is not None else sections[0], f"{prefix}{name}.")
            continue
        rows.append({"field": prefix + name, "value": to_jsonable_python(value),
                     "default": to_jsonable_python(default), "required": f.is_required(),
                     "type": _type_name(f.annotation), "doc": f.description or ""})
    return rows


def _type_name(annotation) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return re.sub(r"\b(typing|pathlib|lifecycle\.[\w.]+)\.", "", text).replace("NoneType", "None")


def json_schema() -> dict:
    """PipelineConfig's JSON Schema (draft 2020-12), for editors (YAML language server) and `jsonschema`."""
    schema = PipelineConfig.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "lifecycle pipeline config"}


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> PipelineConfig:
    path = Path(path or DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"config file {path}: cannot read it: {(e.strerror or str(e)).lower()}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.object[e.start:e.start + 1].hex()} at "
                          f"offset {e.start})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for item in overrides:
        set_dotted(data, *parse_override(item))
    return validate_config(data, origin=str(path))


def validate_config(data: dict, origin: str = "config") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, origin)) from None


# --------------------------------------------------------------------------------------------------
# `lifecycle config show | schema` (registered by lifecycle/cli.py)


def cmd_config_show(args) -> int:
    if args.defaults and (args.config or args.set):
        raise UsageError("--defaults shows the built-in defaults: give it no CONFIG or --set")
    cfg = None if args.defaults else load_config(args.config, args.set or [])
    rows = config_fields(cfg)
    origin = "built-in defaults" if cfg is None else (args.config or DEFAULT_CONFIG)
    if args.json:
        print(json.dumps({"config": origin, "fields": rows}))
        return 0
    import textwrap

    print(f"# {origin}: every field, its value, its default and what it does"
          + ("" if cfg is None else " (* = differs from the default)"))
    for r in rows:
        value = "(required)" if r["required"] and cfg is None else json.dumps(r["value"])
        changed = cfg is not None and r["value"] != r["default"]
        default = "required" if r["required"] else json.dumps(r["default"])
        print(f"{'*' if changed else ' '} {r['field']}: {value}" + (f"   (default {default})" if changed else ""))
        for line in textwrap.wrap(f"{r['type']}. {r['doc']}", 108):
            print(f"      {line}")
    return 0


def cmd_config_schema(args) -> int:
    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}; editors with the YAML language server use it with a first line "
              f"`# yaml-language-server: $schema=<path to it>` in a config", file=sys.stderr)
    return 0


def register_config(sub) -> None:
    cfg = sub.add_parser("config", help="Discover the configuration: every field with its value, default and doc; "
                                        "a JSON Schema for editors.")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="Print the resolved config: each field's value, default and doc.")
    show.add_argument("config", nargs="?", help=f"YAML config (default {DEFAULT_CONFIG})")
    show.add_argument("--set", action="append", metavar="KEY=VALUE", help="Override a field, as for `run`.")
    show.add_argument("--defaults", action="store_true", help="Show the built-in defaults instead of a config.")
    show.add_argument("--json", action="store_true",
                      help="Print one JSON object: {config, fields: [{field, value, default, required, type, doc}]}.")
    show.set_defaults(func=cmd_config_show)
    schema = csub.add_parser("schema", help="Write the config's JSON Schema (for editors: completion, docs on "
                                            "hover and checks in deploy/configs/*.yaml).")
    schema.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: stdout)")
    schema.set_defaults(func=cmd_config_schema)
