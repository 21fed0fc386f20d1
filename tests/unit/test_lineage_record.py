"""What the registry keeps of a trainer's manifest: a tenant writes it, so only known, bounded values."""

from __future__ import annotations

from gateway.storage.verbs import REPORTED_VERSIONS, reported


def test_a_well_formed_manifest_is_kept() -> None:
    manifest = {"spec_hash": "sha256:" + "a" * 64, "steps": 12, "best_step": None, "world_size": 2, "fsdp": True,
                "train_seconds": 3.5, "versions": {"torch": "2.13.0", "peft": "0.18.0"},
                "files": {"adapter_model.safetensors": "sha256:" + "b" * 64}, "attempt": 0}
    got = reported(manifest)
    assert got["spec_hash"] == manifest["spec_hash"] and got["steps"] == 12 and got["world_size"] == 2
    assert got["fsdp"] is True and got["train_seconds"] == 3.5
    assert got["versions"]["torch"] == "2.13.0" and set(got["versions"]) == set(REPORTED_VERSIONS)
    assert got["files"] == manifest["files"] and "attempt" not in got


def test_hostile_values_are_left_out_not_passed_on() -> None:
    manifest = {"spec_hash": "x" * 10_000, "steps": -1, "best_step": True, "world_size": "2", "fsdp": "yes",
                "train_seconds": float("inf"), "versions": {"torch": {"nested": 1}, "peft": "a\nb", "evil": "1"},
                "files": {"a" * 500: "b", "ok": 7}, "extra": "x" * 100}
    got = reported(manifest)
    assert got["spec_hash"] is None and got["steps"] is None and got["best_step"] is None
    assert got["world_size"] is None and got["fsdp"] is None and got["train_seconds"] is None
    assert got["versions"]["torch"] is None and got["versions"]["peft"] is None and "evil" not in got["versions"]
    assert got["files"] == {} and "extra" not in got
    assert reported({"versions": [1, 2], "files": "not a dict"})["versions"]["torch"] is None
