"""Load the node config (placement, SLOs, policies) from YAML; the only place octoserve reads it from disk.

`load_node_config(None)` returns the embedded default, `services/configs/node-default.yaml`, shipped as package
data; a path loads that file instead. The schema is the comment at the top of node-default.yaml; the gang keys
(time-shared GPUs) are documented in full in node-gang.yaml. Validation is `octoserve.services.core.placement.node_config_from_dict`, which raises
one `PlacementError` listing every problem; a file that is not a YAML mapping raises it too.
"""

from __future__ import annotations

import argparse
import io
import os
from importlib import resources
from pathlib import Path

import yaml

from octoserve.services.core.cost_model import COST_PROFILES
from octoserve.services.core.placement import NodeConfig, PlacementError, node_config_from_dict

DEFAULT_CONFIG = "node-default.yaml"
# Sections of the same file that configure the services rather than the placement (services/trust.py reads them).
SERVICE_SECTIONS = ("limits", "tenants", "tls", "elastic", "network")


def default_config_text(name: str = DEFAULT_CONFIG) -> str:
    """The text of an embedded config under services/configs/."""
    return resources.files("octoserve.services").joinpath("configs", name).read_text(encoding="utf-8")


def config_file(arg: str) -> str:
    """The argparse type of a YAML file the user names (`--config`, `--workload`): `arg` when it is a file; else the
    embedded config of that name, given bare (`node-gang.yaml`, `node-gang`) or as its path in a checkout
    (`services/configs/node-gang.yaml`), so the commands the docs show work wherever octoserve is installed.
    Anything else stays as given: reading it is the one-line "no such file" of `octoserve.services.usage`."""
    given = Path(arg)
    if given.is_file() or given.parent not in (Path("."), Path("services/configs")):
        return arg
    embedded = resources.files("octoserve.services").joinpath("configs")
    for name in (given.name, f"{given.name}.yaml"):
        if embedded.joinpath(name).is_file():
            return str(embedded.joinpath(name))
    return arg


def load_node_config(path: str | Path | None = None) -> NodeConfig:
    text = default_config_text() if path is None else Path(path).read_text(encoding="utf-8")
    return node_config_from_text(text, source=str(path or DEFAULT_CONFIG))


def node_config_from_text(text: str, source: str = "<text>") -> NodeConfig:
    return node_config_from_raw(parse_yaml_mapping(text, source))


def node_config_from_raw(raw: dict) -> NodeConfig:
    """The node config of a plain config mapping (`raw_config_with_overrides`), its service sections left out."""
    return node_config_from_dict(placement_part(raw))


def placement_part(data: dict) -> dict:
    """The config mapping without the service sections (limits, tenants, tls), for `node_config_from_dict`."""
    return {k: v for k, v in data.items() if k not in SERVICE_SECTIONS}


def parse_yaml_mapping(text: str, source: str) -> dict:
    """The YAML mapping in `text`; a `PlacementError` naming `source` (the file) and the line when it is not one."""
    stream = io.StringIO(text)
    stream.name = source  # PyYAML names the stream in its messages: the file, not "<unicode string>"
    try:
        data = yaml.safe_load(stream)
    except yaml.YAMLError as e:
        raise PlacementError([f"{source} is not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise PlacementError([f"{source} must hold a YAML mapping with gpu, models, instances, slo, policies"])
    return data


def load_service_sections(path: str | Path | None) -> dict:
    """The limits / tenants / tls / elastic / network sections of a node config file (empty for the embedded default).
    A relative `tls.dir` is made absolute against the file's folder, so every process that reads the file (each
    with its own working directory) finds the same certificates."""
    if path is None:
        return {}
    data = parse_yaml_mapping(Path(path).read_text(encoding="utf-8"), str(path))
    sections = {k: data[k] for k in SERVICE_SECTIONS if data.get(k) is not None}
    return resolve_section_paths(sections, Path(os.path.abspath(path)).parent)


def resolve_section_paths(sections: dict, base: str | Path) -> dict:
    """`sections` with a relative `tls.dir` (`~` expanded) made absolute against `base`; anything else unchanged
    (a malformed section is left for its reader to refuse)."""
    tls = sections.get("tls")
    if isinstance(tls, dict) and isinstance(tls.get("dir"), str) and tls["dir"]:
        directory = os.path.expanduser(tls["dir"])
        if not os.path.isabs(directory):
            directory = os.path.normpath(os.path.join(os.fspath(base), directory))
        sections = {**sections, "tls": {**tls, "dir": directory}}
    return sections


# --- the command line's view of a config: a path, `--set` overrides and `--cost-profile` ----------------------


def add_cost_profile_argument(parser: argparse.ArgumentParser) -> None:
    """`--cost-profile NAME`: sets the config's `cost_profile` key (shared by simulate, plan, up and demo)."""
    parser.add_argument("--cost-profile", choices=list(COST_PROFILES), default=None,
                        help="cost-model constants (default: the config's cost_profile, else 'default')")


def raw_config_with_overrides(path: str | None, overrides: list[str], cost_profile: str | None = None) -> dict:
    """The node config as a plain dict, `section.key=value` overrides and `cost_profile` applied, not validated."""
    from octoserve.services.usage import UsageError

    text = default_config_text() if path is None else Path(path).read_text(encoding="utf-8")
    raw = parse_yaml_mapping(text, str(path or DEFAULT_CONFIG))
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in ("policies", "slo"):
            raise UsageError(f"--set {item!r}: use policies.KEY=VALUE or slo.KEY=VALUE")
        try:
            raw.setdefault(section, {})[name] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UsageError(f"--set {item!r}: VALUE is not valid YAML ({e})") from None
    if cost_profile is not None:
        raw["cost_profile"] = cost_profile
    return raw


def config_source(path: str | None, cost_profile: str | None):
    """What `start_node` takes: the path itself, or a dict when `--cost-profile` changes the config."""
    return path if cost_profile is None else raw_config_with_overrides(path, [], cost_profile)


def load_config_source(source) -> NodeConfig:
    """The node config of what `config_source` returns: None (the embedded default), a path, or a plain mapping."""
    return node_config_from_raw(source) if isinstance(source, dict) else load_node_config(source)


def load_with_overrides(path: str | None, overrides: list[str], cost_profile: str | None = None):
    """The node config with `section.key=value` overrides and `--cost-profile` applied before validation."""
    if not overrides and cost_profile is None:
        return load_node_config(path)
    return node_config_from_raw(raw_config_with_overrides(path, overrides, cost_profile))
