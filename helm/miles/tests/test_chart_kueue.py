"""`kueue.enabled`: the controller is told (MILES_CONTROLLER_KUBERNETES_KUEUE) and may create jobs' Workloads and
write their status; off (the default), neither, and the setting cannot be set behind the chart's back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from miles.common.testing.helm import by_kind

pytestmark = pytest.mark.integration  # runs helm

Renderer = Callable[..., list[dict[str, Any]]]
COMPONENT = "app.kubernetes.io/component"


def _controller(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The controller's Role and its container's env (name -> value)."""
    (role,) = [o for o in by_kind(objects, "Role") if o["metadata"]["labels"][COMPONENT] == "controller"]
    (deployment,) = [o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"][COMPONENT] == "controller"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return role, {env["name"]: env.get("value") for env in container["env"]}


def _kueue_rules(role: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for rule in role["rules"] if "kueue.x-k8s.io" in rule["apiGroups"]]


def test_kueue_enabled_tells_the_controller_and_grants_workloads(
    render: Renderer, validate: Callable[[dict[str, Any]], None]
) -> None:
    objects = render([], ["kueue.enabled=true"])
    role, env = _controller(objects)
    assert env["MILES_CONTROLLER_KUBERNETES_KUEUE"] == "true"
    rules = {tuple(rule["resources"]): set(rule["verbs"]) for rule in _kueue_rules(role)}
    assert rules == {
        ("workloads",): {"get", "list", "watch", "create", "delete"},
        ("workloads/status",): {"get", "patch", "update"},
    }
    validate(role)


def test_kueue_is_off_by_default(render: Renderer) -> None:
    role, env = _controller(render([], []))
    assert "MILES_CONTROLLER_KUBERNETES_KUEUE" not in env
    assert _kueue_rules(role) == []


def test_the_kueue_setting_is_the_charts_to_set(render: Renderer) -> None:
    with pytest.raises(RuntimeError, match=r"kueue\.enabled"):
        render([], ["controller.settings.kubernetes_kueue=true"])
