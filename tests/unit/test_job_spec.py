"""The trainer spec the gateway writes: the site's device setting, and native hyperparameters passed on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api.openai import to_ours
from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob
from gateway.services.jobspec import job_spec
from gateway.storage.layout import result_path
from trainer.catalog import CatalogEntry
from trainer.contract.spec import JobSpec, parse_spec, spec_data, spec_file_text, spec_hash

SHA = "a" * 64
ART = "art-" + "d" * 24
ENTRY = CatalogEntry("tiny-chat", "sha256:" + "b" * 64, "tiny-chat/x", "2026-12-01T00:00:00+00:00", 1)


def _spec(tmp_path: Path, hp: dict[str, object] | None = None, **settings: object) -> dict[str, object]:
    s = Settings(storage_root=tmp_path, database_url="sqlite://", **settings)
    train = DataFile(id="file-1", tenant_id=1, filename="t.jsonl", bytes=10, sha256=SHA)
    job = FineTuningJob(id="ftjob-" + "c" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                        hyperparameters=to_ours(hp or {}))
    return spec_data(job_spec(s, "acme", job, train, None, ENTRY))   # what spec.json holds


def test_default_device_leaves_the_spec_and_its_hash_as_before(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert "device" not in spec and parse_spec(spec).device == "auto"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_site_device_reaches_the_trainer(tmp_path: Path, device: str) -> None:
    spec = _spec(tmp_path, job_device=device)
    assert spec["device"] == device and parse_spec(spec).device == device
    assert spec_hash(parse_spec(spec)) != spec_hash(parse_spec(_spec(tmp_path)))


def test_early_stopping_and_warmup_ratio_pass_through(tmp_path: Path) -> None:
    hp = {"n_epochs": 2, "eval_every_steps": 5, "early_stopping_patience": 2, "warmup_ratio": 0.1}
    parsed = parse_spec(_spec(tmp_path, hp)).hyperparameters
    assert (parsed.early_stopping_patience, parsed.warmup_ratio, parsed.epochs) == (2, 0.1, 2)


def test_early_stopping_without_evals_is_a_clear_400(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="early_stopping_patience .* needs eval_every_steps") as e:
        _spec(tmp_path, {"early_stopping_patience": 2})
    assert e.value.status == 400 and e.value.param == "hyperparameters"


def test_a_gang_job_asks_the_trainer_for_one_rank_per_gpu(tmp_path: Path) -> None:
    s = Settings(storage_root=tmp_path, database_url="sqlite://")
    train = DataFile(id="file-1", tenant_id=1, filename="t.jsonl", bytes=10, sha256=SHA)
    job = FineTuningJob(id="ftjob-" + "c" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                        hyperparameters={}, gpus=4, nodes=2)
    spec = spec_data(job_spec(s, "acme", job, train, None, ENTRY))
    assert spec["world_size"] == 4 and parse_spec(spec).world_size == 4
    assert "world_size" not in _spec(tmp_path)          # one GPU: the spec (and its hash) as before
    sharded = FineTuningJob(id="ftjob-" + "d" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                            hyperparameters={}, gpus=4, nodes=2, fsdp=True)
    assert parse_spec(job_spec(s, "acme", sharded, train, None, ENTRY)).fsdp is True
    assert "fsdp" not in spec and "fsdp" not in _spec(tmp_path)   # not asked for: the spec as before


@pytest.mark.parametrize(("gpus", "nodes", "local", "message"), [
    (3, 2, False, r"resources.gpus \(3\) must be a multiple of resources.nodes \(2\)"),
    (32, 32, False, r"resources.nodes \(32\) is over this site's limit of 16"),
    (16, 1, False, r"16 GPUs per node is over this site's 8 per node"),
    (2, 1, True, "local mode runs one trainer process"),
    (1, 1, True, "resources.fsdp needs a Slurm gang"),
])
def test_gangs_this_site_cannot_run_are_refused(tmp_path: Path, gpus: int, nodes: int, local: bool,
                                               message: str) -> None:
    from gateway.services.jobcreate import check_resources

    s = Settings(storage_root=tmp_path, database_url="sqlite://", **({"backend": "local", "data_dir": tmp_path}
                                                                     if local else {}))
    with pytest.raises(ServiceError, match=message) as e:
        check_resources(s, gpus, nodes, fsdp=local and gpus == 1)
    assert e.value.status == 400 and (e.value.param or "").startswith("resources")
    check_resources(Settings(storage_root=tmp_path, database_url="sqlite://"), 8, 2)   # 4 per node: fine


def test_the_estimate_counts_the_ranks(tmp_path: Path) -> None:
    from gateway.services.jobcreate import estimate

    s = Settings(storage_root=tmp_path, database_url="sqlite://", throughput_tokens_per_s=1000.0,
                 job_overhead_s=0, parallel_efficiency=0.8)
    train = DataFile(id="file-1", tenant_id=1, filename="t.jsonl", bytes=10, sha256=SHA,
                     validation={"stats": {"tokens": {"total": 600_000}}})
    assert estimate(s, train, 1) == (600_000, 15)          # 600 s x 1.5 margin
    assert estimate(s, train, 1, gpus=4) == (600_000, 5)   # 600 s / 3.4 x 1.5 = 4.4 min -> the 5-minute floor
    assert estimate(s, train, 2, gpus=2)[1] < estimate(s, train, 2)[1]


def test_a_continued_job_points_the_trainer_at_its_parents_adapter_tar(tmp_path: Path) -> None:
    s = Settings(storage_root=tmp_path, database_url="sqlite://")
    train = DataFile(id="file-1", tenant_id=1, filename="t.jsonl", bytes=10, sha256=SHA)
    tar = DataFile(id="file-2", tenant_id=1, filename="ftjob-p-adapter.tar", bytes=10, sha256="c" * 64,
                   purpose="fine-tune-results", path=result_path(ART, "adapter.tar"))
    job = FineTuningJob(id="ftjob-" + "e" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                        hyperparameters={}, parent_model="ft:tiny-chat:acme::ftjob-p", init_file="file-2")
    spec = job_spec(s, "acme", job, train, None, ENTRY, tar)
    parsed = parse_spec(spec)
    assert parsed.init_adapter is not None and parsed.init_adapter.sha256 == "c" * 64
    assert parsed.init_adapter.path == str(tmp_path / "tenants" / "acme" / "artifacts" / ART / "adapter.tar")
    assert "init_adapter" not in _spec(tmp_path)    # a fresh job: the spec (and its hash) as before


def _dpo_spec(tmp_path: Path, hp: dict[str, object]) -> dict[str, object]:
    s = Settings(storage_root=tmp_path, database_url="sqlite://")
    train = DataFile(id="file-1", tenant_id=1, filename="p.jsonl", bytes=10, sha256=SHA)
    job = FineTuningJob(id="ftjob-" + "f" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                        hyperparameters=to_ours(hp), method="dpo")
    return spec_data(job_spec(s, "acme", job, train, None, ENTRY))


def test_a_dpo_job_tells_the_trainer_its_method_and_beta(tmp_path: Path) -> None:
    from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, Hyperparameters

    spec = _dpo_spec(tmp_path, {"beta": 0.25, "n_epochs": 2})
    parsed = parse_spec(spec)
    assert parsed.method == "dpo" and parsed.hyperparameters.beta == 0.25
    assert parse_spec(_dpo_spec(tmp_path, {})).hyperparameters.beta == HYPERPARAMETER_DEFAULTS["beta"]
    assert HYPERPARAMETER_DEFAULTS["beta"] == Hyperparameters.model_fields["beta"].default
    sft = _spec(tmp_path)
    assert "method" not in sft and "beta" not in sft["hyperparameters"]   # a supervised spec's hash as before
    assert spec_hash(parsed) != spec_hash(parse_spec(_dpo_spec(tmp_path, {"beta": 0.5, "n_epochs": 2})))


@pytest.mark.parametrize(("hp", "method", "words"), [
    ({"beta": 0.2}, "supervised", "beta is a DPO hyperparameter"),
    ({"max_seq_len": 2048, "batch_size_tokens": 3000}, "dpo", "must be >= 2 * max_seq_len"),
    ({"beta": 0}, "dpo", "beta"),
    ({"lora_dropout": 0.1}, "dpo", "trains without dropout"),
])
def test_dpo_settings_that_cannot_train_are_a_clear_400(tmp_path: Path, hp: dict[str, object], method: str,
                                                        words: str) -> None:
    with pytest.raises(ServiceError) as e:
        _dpo_spec(tmp_path, hp) if method == "dpo" else _spec(tmp_path, hp)
    assert e.value.param == "hyperparameters" and words in str(e.value)


def test_a_supervised_request_keeps_its_idempotency_digest() -> None:
    from gateway.services.jobcreate import JobRequest

    plain = JobRequest(training_file="file-1", model="tiny-chat")
    assert plain.digest() == JobRequest(training_file="file-1", model="tiny-chat", method="supervised").digest()
    assert plain.digest() != JobRequest(training_file="file-1", model="tiny-chat", method="dpo").digest()


def test_a_dpo_job_may_say_dropout_zero(tmp_path: Path) -> None:
    """DPO trains without dropout (as TRL): 0 is accepted (an old client, a sweep), only a non-zero value is refused."""
    assert parse_spec(_dpo_spec(tmp_path, {"lora_dropout": 0.0})).hyperparameters.lora_dropout == 0.0


def test_a_spec_cannot_carry_the_test_suites_fault_injection(tmp_path: Path) -> None:
    """The job spec holds only what a user may ask: the learning-rate blow-up of the test suite is no
    field of it, so a spec (a tenant's rewritten spec.json included) naming it is refused."""
    from trainer.contract.errors import SpecError

    spec = _spec(tmp_path)
    with pytest.raises(SpecError, match="fault_lr_blowup_at_step: unknown key"):
        parse_spec({**spec, "fault_lr_blowup_at_step": 2})


@pytest.mark.parametrize(("env", "step"), [
    ({}, None),
    ({"SFT_TEST_FAULT_LR_BLOWUP_AT_STEP": "3"}, None),          # without the test tier: ignored
    ({"SFT_TEST_TIER": "1"}, None),
    ({"SFT_TEST_TIER": "1", "SFT_TEST_FAULT_LR_BLOWUP_AT_STEP": "3"}, 3),
])
def test_the_fault_is_read_only_under_the_test_tier(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                    step: int | None) -> None:
    from trainer import jobenv

    for name in ("SFT_TEST_TIER", "SFT_TEST_FAULT_LR_BLOWUP_AT_STEP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert jobenv.test_fault_step() == step


def test_the_gateway_adds_only_test_variables_to_a_jobs_environment(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only SFT_TEST_"):
        Settings(storage_root=tmp_path, database_url="sqlite://", test_job_env={"PATH": "/evil"})
    s = Settings(storage_root=tmp_path, database_url="sqlite://", test_job_env={"SFT_TEST_TIER": "1"})
    assert s.test_job_env == {"SFT_TEST_TIER": "1"}


def test_the_gateway_keeps_the_typed_spec_and_writes_exactly_it(tmp_path: Path) -> None:
    """``job_spec`` returns the parsed ``JobSpec`` (not a dict whose parse is thrown away); the file the
    broker writes (``spec_file_text``) reads back equal, with the same hash, and a tampered one does not."""
    from gateway.services.jobspec import saved_spec_matches

    s = Settings(storage_root=tmp_path, database_url="sqlite://", job_device="cuda")
    train = DataFile(id="file-1", tenant_id=1, filename="t.jsonl", bytes=10, sha256=SHA)
    job = FineTuningJob(id="ftjob-" + "c" * 24, tenant_id=1, training_file="file-1", model="tiny-chat",
                        hyperparameters=to_ours({"n_epochs": 2, "learning_rate_multiplier": 2, "lora_r": 8}))
    spec = job_spec(s, "acme", job, train, None, ENTRY)
    assert isinstance(spec, JobSpec) and spec.hyperparameters.epochs == 2 and spec.device == "cuda"
    text = spec_file_text(spec)
    assert parse_spec(json.loads(text)) == spec and spec_hash(parse_spec(json.loads(text))) == spec_hash(spec)
    assert "warmup_steps" not in json.loads(text)["hyperparameters"]     # defaults stay the trainer's
    assert saved_spec_matches(text.encode(), spec)
    assert not saved_spec_matches(text.replace('"lora_r": 8', '"lora_r": 64').encode(), spec)


def test_openai_names_are_translated_once_and_given_back() -> None:
    from gateway.api.openai import BASE_LEARNING_RATE, to_openai
    from trainer.contract.spec import HYPERPARAMETER_DEFAULTS

    ours = to_ours({"n_epochs": 4, "learning_rate_multiplier": 10, "batch_size": 8, "lora_r": "auto"})
    assert ours == {"epochs": 4, "learning_rate": 10 * BASE_LEARNING_RATE}
    assert BASE_LEARNING_RATE == HYPERPARAMETER_DEFAULTS["learning_rate"]
    assert to_openai(ours) == {"n_epochs": 4, "batch_size": "auto", "learning_rate_multiplier": 10}
    assert to_openai({}) == {"n_epochs": HYPERPARAMETER_DEFAULTS["epochs"], "batch_size": "auto",
                             "learning_rate_multiplier": "auto"}
    with pytest.raises(ServiceError) as e:
        to_ours({"learning_rate_multiplier": 0})
    assert e.value.param == "hyperparameters.learning_rate_multiplier"
