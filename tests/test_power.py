"""Power (routing.power): the RAPL reader on a powercap folder laid out as the kernel lays it
out, the configured figures on a real node (``cloud serve --watts``) through ``/load``, the
gateway's ``/admin/nodes`` and ``edgecloud profile``, and the simulator's joules per request."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from routing.policy_config import PolicyConfig
from routing.power import EnergyMeter, RaplReader, Watts, estimated_joules, parse_watts
from routing.sim.fleet import FleetSpec
from routing.sim.metrics import node_table, policy_table, summarize
from routing.sim.profiles import load_profile, profile_name
from routing.sim.simulator import simulate
from routing.sim.trace import TraceRequest
from tests.conftest import free_port
from tests.nodes import Proc, Served, cli


def _zone(root: Path, name: str, label: str, uj: int, span: int) -> Path:
    d = root / name
    d.mkdir()
    (d / "name").write_text(label + "\n")
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{span}\n")
    return d / "energy_uj"


def test_rapl_sums_the_packages_and_undoes_a_wraparound(tmp_path: Path) -> None:
    span = 262_143_328_850  # a real package's max_energy_range_uj
    pkg0 = _zone(tmp_path, "intel-rapl:0", "package-0", span - 1_000_000, span)
    pkg1 = _zone(tmp_path, "intel-rapl:1", "package-1", 5_000_000, span)
    # counted inside their package, or the package read another way: never summed
    core = _zone(tmp_path, "intel-rapl:0:0", "core", 0, span)
    mmio = _zone(tmp_path, "intel-rapl-mmio:0", "package-0", 0, span)
    reader = RaplReader.find(tmp_path)
    assert reader is not None and reader.zones == 2 and reader.read() == 0.0
    pkg0.write_text(f"{2_000_000}\n")  # wrapped: 1 J to the top, 2 J after it
    pkg1.write_text(f"{9_500_000}\n")  # 4.5 J
    core.write_text("7000000\n")
    mmio.write_text("7000000\n")
    assert reader.read() == pytest.approx(7.5)
    pkg0.write_text(f"{2_250_000}\n")
    assert reader.read() == pytest.approx(7.75)  # cumulative


def test_rapl_reads_amd_naming_and_finds_nothing_where_nothing_is_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    amd = tmp_path / "amd"
    amd.mkdir()
    counter = _zone(amd, "amd-rapl:0", "package-0", 100, 1_000_000)
    reader = RaplReader.find(amd)
    assert reader is not None and reader.zones == 1
    counter.write_text("3000100\n")
    assert reader.read() == pytest.approx(3.0)
    vm = tmp_path / "vm"  # a VM: no powercap at all
    assert RaplReader.find(vm) is None
    monkeypatch.setenv("EDGECLOUD_POWERCAP", str(amd))  # the folder a node reads by default
    assert RaplReader.find() is not None
    monkeypatch.setenv("EDGECLOUD_POWERCAP", "")  # none: configured figures only
    assert RaplReader.find() is None
    psys = tmp_path / "psys"
    psys.mkdir()
    _zone(psys, "intel-rapl:1", "psys", 0, 1_000_000)  # the platform zone alone is not summed
    assert RaplReader.find(psys) is None


def test_rapl_measured_watts_and_joules_per_request(tmp_path: Path) -> None:
    counter = _zone(tmp_path, "intel-rapl:0", "package-0", 0, 10**12)
    now = [0.0]
    meter = EnergyMeter(None, RaplReader.find(tmp_path), window_s=1.0, clock=lambda: now[0])
    now[0] = 2.0  # 2 s idle at 3 W, no request: an idle window teaches idle watts only
    counter.write_text("6000000\n")
    meter.sample()
    assert meter.fields() == {
        "watts_idle": pytest.approx(3.0),
        "watts_load": None,
        "joules_per_request": None,
        "power_source": "rapl",
    }
    meter.started()
    now[0] = 3.0  # busy the whole second at 11 W, two requests finish
    meter.ended(True)
    meter.started()
    meter.ended(True)
    counter.write_text("17000000\n")
    meter.sample()
    f = meter.fields()
    assert (f["watts_load"], f["joules_per_request"]) == (pytest.approx(11.0), pytest.approx(5.5))


def test_configured_watts_give_idle_plus_the_busy_share_of_the_window() -> None:
    now = [100.0]
    meter = EnergyMeter(Watts(5.0, 15.0), None, window_s=10.0, clock=lambda: now[0])
    meter.started()
    now[0] = 104.0  # busy 4 s of a 10 s window; 2 requests finish in it
    meter.ended(True)
    meter.started()
    meter.ended(False)  # aborted: not a finished request
    meter.started()
    meter.ended(True)
    now[0] = 105.0
    meter.sample()  # 5 s: the window is still open
    assert meter.fields()["joules_per_request"] is None
    now[0] = 110.0
    meter.sample()
    assert meter.fields() == {
        "watts_idle": 5.0,
        "watts_load": 15.0,
        "joules_per_request": pytest.approx((5 * 10 + 10 * 4) / 2),
        "power_source": "configured",
    }
    assert estimated_joules(Watts(5.0, 15.0), 10.0, 4.0) == 90.0
    assert parse_watts("4.5:15") == Watts(4.5, 15.0)
    for bad in ("15:4", "4", "a:b", "-1:3"):
        with pytest.raises(ValueError):
            parse_watts(bad)


def test_profile_names_keep_providers_apart() -> None:
    assert profile_name("edge", "smollm2-135m-instruct", "OpenVINO:CPU") == (
        "edge-smollm2-135m-instruct-openvino-cpu"
    )
    assert profile_name("edge", "smollm2-135m-instruct", "CPU") == "edge-smollm2-135m-instruct-cpu"


@pytest.fixture(scope="module")
def watt_node(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """``cloud serve --watts 4:12`` on the tiny model, a real node process."""
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "watts.log"
    args = cli(
        "cloud", "serve", "--model", str(tiny_model_path), "--port", str(port),
        "--device", "cpu", "--threads", "1", "--node-id", "cloud-watts", "--watts", "4:12",
    )  # fmt: skip
    p = Proc(args, port, log, env={"EDGECLOUD_POWERCAP": ""}).wait_ready()  # RAPL or not here
    yield p
    assert p.stop() == 0, p.tail()


def test_node_reports_watts_and_joules_per_request(watt_node: Proc) -> None:
    url = watt_node.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    sent0 = time.monotonic()
    first = httpx.get(url + "/load").json()  # closes the start-up window (nothing finished)
    back0 = time.monotonic()
    assert (first["watts_idle"], first["watts_load"]) == (4.0, 12.0)
    assert first["power_source"] == "configured" and first["joules_per_request"] is None
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    for _ in range(3):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(max(0.0, 1.2 - (time.monotonic() - back0)))
    sent1 = time.monotonic()
    state = httpx.get(url + "/load").json()
    back1 = time.monotonic()
    # one window of w seconds, 3 requests: between idle all along and fully busy all along
    jpr = state["joules_per_request"]
    assert 4.0 * (sent1 - back0) / 3 <= jpr <= 12.0 * (back1 - sent0) / 3, (jpr, state)


def test_admin_nodes_and_profile_carry_the_power_figures(watt_node: Proc, tmp_path: Path) -> None:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    gw = Served(create_gateway_app(GatewayConfig(nodes=[watt_node.url])))
    try:
        deadline = time.monotonic() + 30
        while not (nodes := httpx.get(gw.url + "/admin/nodes").json()["nodes"]):
            assert time.monotonic() < deadline, "the gateway never saw the node"
            time.sleep(0.05)
    finally:
        gw.stop()
    (node,) = nodes
    assert (node["watts_idle"], node["watts_load"], node["power_source"]) == (4, 12, "configured")
    assert node["joules_per_request"] > 0  # learned by the test before
    args = ["profile", "--node", watt_node.url, "--out", str(tmp_path), "--prefill", "16", "64"]
    args += ["--batches", "1", "--contexts", "64", "--decode-tokens", "8", "--repeats", "1"]
    done = subprocess.run(cli(*args), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("*.json")
    profile = load_profile(path)
    assert path.name == f"cloud-{node['models'][0]}-cpu.json" == f"{profile.name}.json"
    assert profile.identity == ("cloud", node["models"][0], "cpu")
    assert (profile.watts_idle, profile.watts_load) == (4.0, 12.0)


def _sim_fleet(tmp: Path, **watts: float) -> FleetSpec:
    """One cloud node: 1 ms per prompt token, 10 ms per decode step, ``watts`` figures."""
    data = {
        "name": "hand-cloud", "kind": "cloud", "source": "synthetic", "slots": 8,
        "kv_blocks": 1000, "max_context": 8192,
        "prefill": [{"tokens": 1000, "ms": 1000.0}, {"tokens": 2000, "ms": 2000.0}],
        "decode": [{"batch": 1, "context": 16, "ms_per_step": 10.0},
                   {"batch": 64, "context": 16, "ms_per_step": 10.0}],
        **watts,
    }  # fmt: skip
    path = tmp / "cloud.json"
    path.write_text(json.dumps(data))
    return FleetSpec.model_validate(
        {
            "regions": {"intra_region_ms": 1e-6},
            "gateways": [{"region": "local", "overhead_ms": 0.0}],
            "nodes": [{"id": "n", "kind": "cloud", "region": "local", "profile": str(path)}],
        }
    )


def test_simulator_reports_joules_per_request_beside_latency(tmp_path: Path) -> None:
    trace = [TraceRequest(arrival_s=0.0, prompt_tokens=32, output_tokens=5)]
    # busy 72 ms (32 ms prefill, four 10 ms decode steps): at 10 W under load and none idle
    res = simulate(trace, _sim_fleet(tmp_path, watts_idle=0.0, watts_load=10.0), PolicyConfig())
    assert res.e2e_s == pytest.approx([0.072], abs=1e-6)
    assert summarize(res)["joules_per_request"] == pytest.approx(0.72)
    table = policy_table({"latency": summarize(res)})
    assert "J/req" in table.splitlines()[0] and table.splitlines()[2].endswith("0.720")
    assert node_table(res).splitlines()[2].split()[-1] == "0.720"
    # idle watts count over the whole run, however long the simulator ran
    res = simulate(trace, _sim_fleet(tmp_path, watts_idle=2.0, watts_load=12.0), PolicyConfig())
    run_s = 0.072 / res.node_stats["n"]["busy_share"]
    assert summarize(res)["joules_per_request"] == pytest.approx(2.0 * run_s + 10.0 * 0.072)
    unknown = simulate(trace, _sim_fleet(tmp_path), PolicyConfig())  # no figures
    assert math.isnan(summarize(unknown)["joules_per_request"])
