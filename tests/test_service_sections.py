"""The limits / tenants / tls sections of the node config: read beside the placement, validated, documented."""

from __future__ import annotations

import pytest
import yaml

from octoserve.router.tenants import tenant_settings_from_dict
from octoserve.services.config import default_config_text, load_node_config, load_service_sections
from octoserve.services.rpc.limits import Limits, limits_from_dict
from tests.service_fixtures import small_config_dict


def test_sections_sit_beside_the_placement_without_disturbing_it(tmp_path):
    path = tmp_path / "node.yaml"
    sections = {"limits": {"max_stop_strings": 8}, "tenants": {"list": [{"name": "a", "key": "k-1"}]},
                "tls": {"dir": str(tmp_path)}}
    path.write_text(yaml.safe_dump({**small_config_dict(), **sections}))
    assert load_node_config(path) == load_node_config_from(small_config_dict(), tmp_path)
    assert load_service_sections(path) == sections
    assert load_service_sections(None) == {}
    assert limits_from_dict(sections["limits"]) == Limits(max_stop_strings=8)
    assert tenant_settings_from_dict(sections["tenants"]).tenants[0].name == "a"


def load_node_config_from(d, tmp_path):
    p = tmp_path / "plain.yaml"
    p.write_text(yaml.safe_dump(d))
    return load_node_config(p)


@pytest.mark.parametrize("bad,match", [({"max_stop_string": 3}, "unknown key"), ({"max_stop_strings": 0}, "positive"),
                                       ({"max_message_bytes": "4MiB"}, "positive integer")])
def test_bad_limits_are_refused_with_the_key_named(bad, match):
    with pytest.raises(ValueError, match=match):
        limits_from_dict(bad)


def test_the_config_schema_comment_documents_every_limit():
    text = default_config_text()
    for name in Limits.__dataclass_fields__:
        assert f"{name}: {getattr(Limits(), name)}" in text
    for section in ("limits:", "tenants:", "tls:"):
        assert f"#   {section}" in text


def test_the_launcher_refuses_a_bad_section_before_starting_anything(tmp_path):
    from octoserve.services.node.launcher import LaunchError, start_node

    with pytest.raises(LaunchError, match="max_stop_string"):
        start_node({**small_config_dict(), "limits": {"max_stop_string": 3}}, run_dir=tmp_path)
    with pytest.raises(LaunchError, match="octoserve certs"):
        start_node({**small_config_dict(), "tls": {"dir": str(tmp_path / "none")}}, run_dir=tmp_path)
    assert not list(tmp_path.glob("*.log"))  # no process was started
