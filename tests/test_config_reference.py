"""docs/configuration.md and examples/policy.yaml are what the generator makes from the
settings models and the argument parsers (regenerate: python scripts/gen_config_reference.py)."""

from __future__ import annotations

import importlib.util

from tests.nodes import REPO


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts/gen_config_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_is_up_to_date() -> None:
    gen = _generator()
    assert (REPO / "docs/configuration.md").read_text() == gen.reference(), (
        "stale: run python scripts/gen_config_reference.py"
    )
    assert (REPO / "examples/policy.yaml").read_text() == gen.policy_example()


def test_reference_names_every_setting_and_flag() -> None:
    from gateway.cli import all_parsers
    from gateway.front.config import GatewayConfig
    from routing.policy_config import PolicyConfig

    text = (REPO / "docs/configuration.md").read_text()
    for model in (GatewayConfig, PolicyConfig):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, name
    for p in all_parsers():
        for a in p._actions:
            for flag in a.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--verbose", "--debug"):
                    assert flag in text, (p.prog, flag)


def test_the_policy_file_stays_small() -> None:
    """At most 25 settings in the policy YAML: internal constants live in code."""
    import yaml

    def settings(node: object) -> int:
        if isinstance(node, dict) and node:
            return sum(settings(v) for v in node.values())
        return 1

    assert settings(yaml.safe_load((REPO / "examples/policy.yaml").read_text())) <= 25
