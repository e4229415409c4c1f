"""GPU groups (issue 31 §3) and training on the run's GPUs (§5), as launched: for each layout, the command and
environment of every engine `dfpipe run --gpus` would start (from the generator's own argv, through the real
`dfpipe generate` parser, to the SGLang server command) and of the trainer. Fast tier: nothing is started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.generator.backends.sglang import SGLangBackend
from services.generator.cli import engine_group
from services.pipeline.layout import TRAINING_HEADROOM, fit_problem, target_bytes_bf16
from services.pipeline.run import RunRequest, service_specs
from shared.cli import build_parser
from shared.config import Config
from shared.gpus import GpuGroup, LayoutError, parse_layout


def config(target: Path, **sections: Any) -> Config:
    return msgspec.convert({"run": "r1", "model": {"target": str(target)}, **sections}, Config)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A model directory as resolve_target accepts it (the launch command names it; nothing loads it)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (d / "model.safetensors").write_bytes(b"\0" * 4000)
    return d


def test_both_spellings_name_the_same_groups_and_bad_layouts_say_what_is_wrong() -> None:
    assert parse_layout("0,1,2,3", 2) == parse_layout("0-1,2-3") == [GpuGroup((0, 1)), GpuGroup((2, 3))]
    assert parse_layout("0-1,2-3", 2) == parse_layout("0-1,2-3")
    assert parse_layout("0,1,2,3") == [GpuGroup((g,)) for g in range(4)]
    assert parse_layout("4-7") == [GpuGroup((4, 5, 6, 7))]
    assert parse_layout("0-1,4-5") == [GpuGroup((0, 1)), GpuGroup((4, 5))]  # an order --tp cannot say
    for spec, tp, said in [("0,1,2", 2, "do not split into groups of --tp 2"), ("0-1,2", 1, "different sizes"),
                           ("0,1,1,2", 1, "GPU 1 named twice"), ("0-1,1-2", 1, "GPU 1 named twice"),
                           ("0-1,2-3", 4, "groups of 2, but --tp 4"), ("a,b", 1, "'a' is not a GPU index"),
                           ("3-1", 1, "runs backwards"), ("", 1, "no GPU named"), ("0,1", 0, "at least 1")]:
        with pytest.raises(LayoutError, match=said):
            parse_layout(spec, tp)


LAYOUTS = {  # name: (--gpus, --tp, the groups' CUDA_VISIBLE_DEVICES)
    "tp1x4": ("0,1,2,3", 1, ["0", "1", "2", "3"]),
    "tp2x2": ("0,1,2,3", 2, ["0,1", "2,3"]),
    "tp2x2-written": ("0-1,2-3", 1, ["0,1", "2,3"]),
    "tp4x1": ("0,1,2,3", 4, ["0,1,2,3"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_group_launches_one_tensor_parallel_engine_on_its_gpus(name: str, target: Path) -> None:
    gpus, tp, visible = LAYOUTS[name]
    cfg = config(target, generator={"backend": "sglang", "launch": True})
    groups = parse_layout(gpus, tp)
    specs = service_specs(cfg, RunRequest(prompts=["p.jsonl"], generators=list(groups), backend="sglang",
                                          dashboard=False))
    gens = [s for s in specs if s.name.startswith("generator-")]
    assert len(gens) == len(visible)
    workers, ports = [], []
    for spec, devices in zip(gens, visible, strict=True):
        argv = spec.argv[spec.argv.index("shared.cli") + 1:]
        args = build_parser().parse_args(argv)  # what the generator process itself will parse
        group = engine_group(args.gpu, args.gpus, args.tp)
        assert group is not None and group.visible_devices == devices
        assert args.launch and args.backend == "sglang"
        gcfg = msgspec.structs.replace(cfg, generator=msgspec.structs.replace(cfg.generator, engine_url=args.engine_url))
        backend = SGLangBackend(gcfg, gpus=group)
        cmd = backend.launch_command()
        assert cmd[cmd.index("--tp-size") + 1] == str(len(devices.split(",")))
        assert cmd[cmd.index("--model-path") + 1] == str(target)
        env = backend.launch_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
        assert env["CUDA_VISIBLE_DEVICES"] == devices and env["PATH"] == "/bin"
        workers.append(args.worker)
        ports.append(cmd[cmd.index("--port") + 1])
        assert "CUDA_VISIBLE_DEVICES" not in spec.env  # the generator itself sees the node; its engine gets the group
    assert len(set(workers)) == len(workers) == len(set(ports))  # unique workers; servers of one host do not collide
    assert ports == [str(30000 + i) for i in range(len(gens))]
    # training: every GPU of the run, one torchrun rank each (NCCL: Dist picks it where CUDA is seen)
    trainer = next(s for s in specs if s.name == "trainer")
    assert trainer.deferred and trainer.one_shot
    assert trainer.argv[trainer.argv.index("--nproc_per_node") + 1] == "4"
    assert trainer.argv[1:3] == ["-m", "torch.distributed.run"] and trainer.argv[-3:] == ["-m", "shared.cli", "train"]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and trainer.env["DFLASH_RUN"] == "r1"


def test_engines_not_ours_get_the_urls_given_and_training_the_gpus_named(target: Path) -> None:
    cfg = config(target, generator={"backend": "sglang"},
                 layout={"engine_urls": ["http://a:30000", "http://b:30000"], "train_gpus": [6, 7]})
    specs = service_specs(cfg, RunRequest(prompts=["p"], generators=list(parse_layout("0-1,2-3")), dashboard=False))
    urls = [s.argv[s.argv.index("--engine-url") + 1] for s in specs if s.name.startswith("generator-")]
    assert urls == ["http://a:30000", "http://b:30000"]
    assert all("--launch" not in s.argv for s in specs)
    trainer = next(s for s in specs if s.name == "trainer")
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "6,7" and "2" in trainer.argv
    with pytest.raises(LayoutError, match="2 engine URL"):
        service_specs(cfg, RunRequest(prompts=["p"], generators=list(parse_layout("0,1,2,3")), dashboard=False))


def test_one_gpu_trains_in_one_process_and_cpu_ranks_run_under_torchrun_on_gloo(target: Path) -> None:
    one = service_specs(config(target), RunRequest(prompts=["p"], generators=[GpuGroup((3,))], backend="hf",
                                                   dashboard=False))
    trainer = next(s for s in one if s.name == "trainer")
    assert "torch.distributed.run" not in trainer.argv and trainer.argv[-2:] == ["--run", "r1"]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "3"
    gen = next(s for s in one if s.name == "generator-0")
    assert gen.argv[gen.argv.index("--worker") + 1] == "gen0-gpu3"
    cpu = service_specs(config(target, layout={"cpu_train_ranks": 2}),
                        RunRequest(prompts=["p"], generators=[None, None], dashboard=False))
    trainer = next(s for s in cpu if s.name == "trainer")
    assert trainer.argv[trainer.argv.index("--nproc_per_node") + 1] == "2"
    assert trainer.env["DFLASH_MODEL__DEVICE"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in trainer.env
    assert [s.argv[s.argv.index("--worker") + 1] for s in cpu if s.name.startswith("generator-")] == ["gen0", "gen1"]


def test_dfpipe_generate_runs_one_engine_per_group() -> None:
    assert engine_group(None, "2-3", 1) == engine_group(None, "2,3", 2) == GpuGroup((2, 3))
    assert engine_group(5, None, 1) == GpuGroup((5,)) and engine_group(None, None, 1) is None
    with pytest.raises(LayoutError, match="2 groups; one `dfpipe generate` runs one engine"):
        engine_group(None, "0,1,2,3", 2)
    with pytest.raises(LayoutError, match="not both"):
        engine_group(0, "0-1", 1)


def test_a_target_too_large_for_one_training_gpu_is_refused_at_start(target: Path) -> None:
    assert target_bytes_bf16(target) == 2000  # fp32 files → bf16 on the GPU
    gib = 2**30
    assert fit_problem(16 * gib, 80 * gib, [GpuGroup((0,))]) is None
    assert fit_problem(16 * gib, 0, [None]) is None  # no GPU seen: nothing to say
    said = fit_problem(54 * gib, 48 * gib, list(parse_layout("0,1,2,3", 2)))
    assert said and "54.0 GiB" in said and "out of scope" in said and "--no-train" in said and "groups of 2" in said
    assert fit_problem(int(48 * gib * (1 - TRAINING_HEADROOM)) + 1, 48 * gib, [GpuGroup((0,))])


def test_a_cpu_pinned_model_trains_on_cpu_ranks_whatever_gpus_the_engines_had(target: Path) -> None:
    cfg = config(target, model={"target": str(target), "device": "cpu"}, layout={"cpu_train_ranks": 2})
    specs = service_specs(cfg, RunRequest(prompts=["p"], generators=list(parse_layout("0-1,2-3")), backend="sglang",
                                          dashboard=False))
    trainer = next(s for s in specs if s.name == "trainer")
    assert trainer.argv[trainer.argv.index("--nproc_per_node") + 1] == "2" and "CUDA_VISIBLE_DEVICES" not in trainer.env


def test_compose_shows_a_tp2_layout() -> None:
    import yaml

    from tests.test_compose import ROOT, _active, _gpu_ids

    services = _active(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"], "gpu-tp2")
    server, gen = services["sglang-tp2-0"], services["generator-tp2-0"]
    assert _gpu_ids(server) == ["0", "1"] and server["command"][server["command"].index("--tp-size") + 1] == "2"
    assert "sglang.launch_server" in server["command"] and "/health_generate" in " ".join(server["healthcheck"]["test"])
    assert gen["depends_on"]["sglang-tp2-0"]["condition"] == "service_healthy"
    assert "http://sglang-tp2-0:30000" in gen["command"]
    args = build_parser().parse_args([a.replace("${DFLASH_RUN:-demo}", "demo") for a in gen["command"]])
    assert args.worker == "gpu0-1" and args.backend == "sglang"
    assert {"trainer-gpu", "eval-gpu", "feeder", "tokenizer"} <= set(services)
    assert not any(n in services for n in ("sglang-0", "generator-0", "generator-cpu"))  # one layout per profile
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"profile gpu-tp2: {name} depends on {dep}, which is not started"


def test_dfpipe_run_refuses_a_layout_that_cannot_run_before_anything_starts(target: Path) -> None:
    from services.pipeline.cli import _placed

    cfg = config(target)
    for argv, said in [(["--gpus", "0,1,2", "--tp", "2"], "do not split into groups of --tp 2"),
                       (["--gpus", "0-1,2-3"], "hf backend runs one GPU per engine"),
                       (["--gpus", "0,1", "--backend", "sglang", "--engine-urls", "http://a:1"], "1 engine URL"),
                       (["--tp", "2"], "--tp 2 needs --gpus")]:
        args = build_parser().parse_args(["run", "--run", "r1", *argv])
        with pytest.raises(LayoutError, match=said):
            _placed(cfg, args)
    args = build_parser().parse_args(["run", "--run", "r1", "--gpus", "0,1,2,3", "--tp", "2", "--backend", "sglang",
                                      "--launch", "--train-gpus", "0,1"])
    placed, groups = _placed(cfg, args)
    assert groups == parse_layout("0-1,2-3") and placed.generator.launch and placed.layout.train_gpus == [0, 1]


def test_the_engines_a_run_launches_are_the_ones_it_waits_for_before_training(target: Path) -> None:
    from services.pipeline.layout import launched_engine_urls

    groups = list(parse_layout("0,1,2,3", 2))
    launched = config(target, generator={"backend": "sglang", "launch": True, "engine_url": "http://127.0.0.1:31000"})
    assert launched_engine_urls(launched, groups, None) == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert launched_engine_urls(config(target, generator={"backend": "sglang"}), groups, None) == []  # not ours
    assert launched_engine_urls(config(target), [GpuGroup((0,))], "hf") == []  # the generator process is the engine
