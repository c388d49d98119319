"""`murmur node run` against a pipelined run, with real processes on loopback: the coordinator
decides each volunteer's role (a lease under ``pipeline.drivers`` makes a driver, the rest serve
stages), the three volunteers train the run through the stages, and none of them trains the whole
model data parallel or commits data-parallel tokens."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _net_helpers import python_env
from _pipeline_helpers import coordinator, free_port_pair, ledger_tokens

from murmur.node.testnet.procs import start_murmur

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 16  # microbatches of 4 rows: the run's schedule, which the driver volunteer follows
PIPELINE = [
    "pipeline.stages=2", "pipeline.drivers=1", "pipeline.rebalance_every_s=600.0", "pipeline.replica_every_s=0",
    "pipeline.target_samples=8", "pipeline.microbatch_size=4", "pipeline.hop_timeout_s=20.0",
    "pipeline.sync_every_s=0", "train.batch_size=4", "train.eval_batches=1", "optim.warmup_steps=0",
    f"train.steps={STEPS}", "train.eval_every=8",
]
START_TIMEOUT_S = 180.0  # torch and grpc imported by three processes on a loaded 2-core machine


class Volunteer:
    """One `murmur node run` process and the JSON log lines it wrote."""

    def __init__(self, tmp: Path, name: str, join: tuple[str, str], *extra: str) -> None:
        self.name, self.state = name, tmp / name
        self.out = tmp / f"{name}.log"
        self._file = open(self.out, "ab")  # noqa: SIM115 - the child writes it; closed in stop()
        args = ["node", "run", "--coordinator", join[0], "--token", join[1], "--state-dir", str(self.state),
                "--name", name, "--device", "cpu", "--threads", "1", "--metrics-listen", "off",
                "--log-format", "json", *extra]
        self.proc = start_murmur(args, env=python_env(), stdout=self._file, stderr=subprocess.STDOUT)

    def messages(self) -> list[str]:
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line)["msg"])
            except (ValueError, KeyError, TypeError):
                out.append(line)  # stderr's lines (the stage peer's progress, warnings)
        return out

    def events(self, event: str) -> list[dict]:
        return [json.loads(m.split(" ", 1)[1]) for m in self.messages() if m.startswith(event + " {")]

    def wait(self, what: str, ok, timeout_s: float = START_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = ok()
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        got = ok()
        if got:
            return got
        raise AssertionError(f"{self.name}: no {what} (rc {self.proc.poll()}):\n" + "\n".join(self.messages()[-40:]))

    def stop(self, timeout_s: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop on SIGTERM:\n" + "\n".join(self.messages()[-40:])) from None
        finally:
            self._file.close()


def left(v: Volunteer) -> str:
    return next((m for m in v.messages() if m.startswith("left the run: ")), "")


def test_volunteers_serve_stages_and_drive_a_pipelined_run_as_the_coordinator_decides(tmp_path, byte_dataset):
    with coordinator(tmp_path, byte_dataset.root, joins=3, overrides=PIPELINE) as (net, join):
        vols: list[Volunteer] = []
        try:
            # The first asks for a lease and gets it: the run wants one driver.
            vols.append(Volunteer(tmp_path, "first", join, "--data", str(byte_dataset.root)))
            vols[0].wait("role", lambda: any(m.startswith("role: driver") for m in vols[0].messages()))
            # The others are refused a lease (the run has its driver) and serve the two stages the
            # coordinator assigns them; no data needed for that.
            # "second" on fixed ports: its --listen port for the stage service, the next one for
            # its peer server, both advertised under --advertise-host.
            port = free_port_pair()
            vols.append(Volunteer(tmp_path, "second", join, "--listen", f"127.0.0.1:{port}",
                                  "--advertise-host", "localhost"))
            vols.append(Volunteer(tmp_path, "third", join))
            readies = [v.wait("ready", lambda v=v: v.events("ready")) for v in vols[1:]]
            # The driver follows the run's schedule to its end and leaves.
            code = vols[0].proc.wait(START_TIMEOUT_S * 2)
            tokens, _ = ledger_tokens(net)
        finally:
            codes = [v.stop() for v in vols]
    driver, stages = vols[0], vols[1:]
    assert code == 0 and codes[0] == 0, driver.messages()[-40:]
    for v in stages:
        assert any(m.startswith("role: stage peer (no lease: the run has the 1 driver(s)") for m in v.messages())
    assert sorted(r[0]["stage"] for r in readies) == [0, 1], readies
    assert (readies[0][0]["address"], readies[0][0]["state_address"]) == (f"localhost:{port}", f"localhost:{port + 1}")
    assert codes[1:] == [0, 0], [v.messages()[-20:] for v in stages]
    (done,) = driver.events("done")
    assert done["reason"] == "schedule done", done
    assert done["committed_tokens"] == tokens == STEPS * 4 * 64  # the ledger holds the driver's microbatches
    assert driver.events("val"), "the run's val loss through the stages"
    assert "this node committed 4,096 tokens" in left(driver), left(driver)
    # The stage peers computed the microbatches and committed nothing: no lease, no round, no token.
    for v in stages:
        (stopped,) = v.events("stopped")
        # (the last stage's forward is part of its backward call: backwards count for both)
        assert stopped["backwards"] >= STEPS and stopped["optimizer_steps"] > 0, stopped
        assert "this node committed 0 tokens in 0 round(s)" in left(v), left(v)
        assert not any(m.startswith("leased shard") for m in v.messages())
        assert not (v.state / "rounds.jsonl").exists()


def test_a_pipeline_role_against_a_data_parallel_run_is_a_one_line_error(tmp_path, byte_dataset):
    with coordinator(tmp_path, byte_dataset.root, joins=1) as (net, join):
        v = Volunteer(tmp_path, "staged", join, "--role", "stage")
        try:
            code = v.proc.wait(START_TIMEOUT_S)
        finally:
            v.stop()
        view = net.admin("status", "--run", net.run_id)
    assert code != 0
    errors = [m for m in v.messages() if m.startswith("error:")]
    assert errors == [f"error: run {net.run_id} is not pipelined (its config has no [pipeline] section): "
                      "--role stage needs one; leave --role out to train it data parallel"], v.messages()
    assert int(view["run"]["tokens_committed"]) == 0


def test_a_stage_volunteer_restarted_with_its_folder_says_so_before_it_loads_its_stage(tmp_path, byte_dataset):
    """SIGKILLed and started again with its state folder, a `--role stage` volunteer rejoins as the
    same node and first reports no stage, which the coordinator records as the stage's peer
    restarting (``stage_restarted``): until the stage is loaded, no driver is sent to the killed
    process's address. The TTLs are long, so nothing else would tell the coordinator."""
    slow = ["--heartbeat-ttl", "60", "--lease-ttl", "120", "--restart-grace", "1"]
    overrides = [*PIPELINE, "pipeline.checkpoint_every_s=1.0"]
    with coordinator(tmp_path, byte_dataset.root, joins=1, overrides=overrides, coordinator_args=slow) as (net, join):
        v = Volunteer(tmp_path, "staged", join, "--role", "stage")
        try:
            (first,) = v.wait("ready", lambda: v.events("ready"))
            # With a checkpoint in its folder, a restart claims that stage and loads it before it
            # hears from the coordinator: the case where the early report matters.
            v.wait("a checkpoint", lambda: list((v.state / "stage-checkpoints").glob("*.pt")))
            v.proc.send_signal(signal.SIGKILL)
            v.stop()  # dead already: it waits and closes the log
            v = Volunteer(tmp_path, "staged", join, "--role", "stage")  # the same folder: a rejoin, no token spent
            v.wait("second ready", lambda: v.events("ready")[1:])
            events = net.admin("events", "--run", net.run_id)["events"]
        finally:
            v.stop()
    node = first["node_id"]
    assert [e["node_id"] for e in events if e["kind"] == "join"] == [node], events
    restarted = [e for e in events if e["kind"] == "stage_restarted"]
    assert [(e["node_id"], e["detail"]["stage"]) for e in restarted] == [(node, first["stage"])], events
    assert v.events("ready")[1]["node_id"] == node and v.events("ready")[1]["stage"] == first["stage"]
