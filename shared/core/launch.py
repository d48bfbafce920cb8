"""Before and after the recipe builds its Accelerator: each launch snag of this stack is handled here, once, with
the reason beside it. The recipe itself builds `Accelerator(...)`, with the arguments that change behaviour."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import InitProcessGroupKwargs, TorchDynamoPlugin, set_seed
from torch.distributed.elastic.multiprocessing.errors import record

from . import quiet, rules, rundir
from .args import FROM_SCRATCH_LR, PRETRAINED_LR
from .boundary import debugging
from .errors import CheckpointError, LaunchError, RecipeError, RunFinished

logger = logging.getLogger("recipes")


def entrypoint(main: Callable[..., dict | None]) -> Callable[..., dict | None]:
    """A recipe's main(). Under `accelerate launch` or torchrun every process would print a refusal, and the
    launcher's 30-line traceback would bury it: there each process writes it to torch elastic's error file instead,
    and the launcher's failure summary, the last thing it prints, shows it as the reason the run stopped. A crash
    is recorded there with its traceback (torch's `record`). Without a launcher a refusal prints as usual."""

    def finished_or_run(argv: list[str] | None) -> dict | None:
        try:
            return main(argv)
        except RunFinished as done:  # written once: what the finished run wrote, left as it is
            return done.results

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> dict | None:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torch elastic in each child
        try:
            if not error_file:
                return finished_or_run(argv)
            return record(finished_or_run)(argv)
        except RecipeError as exc:  # the message alone, as SystemExit(message) shows it; `raise` keeps the cause
            if debugging(argv):  # --debug / RECIPES_DEBUG=1: the library's traceback that caused it, then the message
                traceback.print_exception(exc)
            if not error_file:
                _repeat_after_launcher(str(exc))
                raise SystemExit(str(exc)) from exc
            _write_refusal(error_file, str(exc))
            raise SystemExit(1) from None
        except SystemExit as exc:
            if not error_file or not isinstance(exc.code, str):
                raise
            _write_refusal(error_file, exc.code)
            raise SystemExit(1) from None
        finally:
            rundir.release()  # the output directory's lock (shared/core/rundir.py)

    return run


def _repeat_after_launcher(message: str) -> None:
    """`accelerate launch` of one process (no torch elastic, so no error file) answers any failed child with its own
    CalledProcessError traceback, printed after the refusal: a helper process waits for the launcher to exit and
    prints the refusal again, so that it is the last thing on the screen (the first copy stays, should it fail)."""
    import subprocess
    import sys

    parent = os.getppid()
    try:
        launcher = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "ACCELERATE_DYNAMO_MODE" not in os.environ or "accelerate" not in launcher:
        return
    wait = ("import os, sys, time\nfor _ in range(500):\n    if not os.path.exists(f'/proc/{sys.argv[1]}'): break\n"
            "    time.sleep(0.02)\nsys.stderr.write('\\n' + sys.argv[2] + '\\n')")
    subprocess.Popen([sys.executable, "-c", wait, str(parent), f"{message}\n(the reason the launch above failed)"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def _write_refusal(error_file: str, message: str) -> None:
    # A plain-string message is shown as it is (a dict would be shown as its traceback). The other local ranks
    # refuse the same run with the same words: they point to local rank 0 rather than repeat it.
    rank0_file = Path(error_file).parent.parent / "0" / Path(error_file).name
    if os.environ.get("LOCAL_RANK", "0") != "0":
        for _ in range(20):  # local rank 0 writes its file at about the same moment
            if rank0_file.exists() and message in rank0_file.read_text():
                message = "The same refusal as local rank 0 (its message is the root cause above)."
                break
            time.sleep(0.1)
    Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def resolve_mixed_precision(args: argparse.Namespace, recipe_default: str) -> str:
    """The flag, else the accelerate config (which `accelerate launch` passes as an env var), else the recipe. Both
    set, and differently: refused (one would be dropped unsaid); the config's 'no' (its default) sets none."""
    from_config = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if args.mixed_precision:
        _one_source("--mixed_precision", args.mixed_precision, "mixed_precision", from_config, from_config != "no")
        return args.mixed_precision
    return from_config if from_config != "no" else recipe_default


def resolve_compile(args: argparse.Namespace) -> str:
    """none | regional | full: the flag, else the accelerate config's dynamo_config (which `accelerate launch`
    passes as ACCELERATE_DYNAMO_* variables; only the inductor backend is checked here, so others are refused). Both
    set, differently: refused."""
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    regional = os.environ.get("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "false").lower() in ("1", "true", "yes")
    if args.torch_compile:
        _one_source("--torch_compile", args.torch_compile, "dynamo_config", "regional" if regional else "full",
                    backend == "inductor")
        return args.torch_compile
    if backend == "no":
        return "none"
    if backend != "inductor":
        raise LaunchError(f"dynamo_backend {backend!r} in the launch config: only inductor is run and tested here. "
                          "Set dynamo_backend: INDUCTOR (or NO), or pass --torch_compile regional|full.")
    return "regional" if regional else "full"


def _one_source(flag: str, value: str, key: str, from_config: str, config_sets: bool) -> None:
    """A setting given by a flag and by the launch config, differently: which one the user meant is not ours to pick."""
    if config_sets and from_config != value:
        raise LaunchError(f"{flag} {value} and the launch config's {key} ({from_config}, which `accelerate launch` "
                          f"passes on from --config_file or its own flags) differ: one would be dropped unsaid. Set it "
                          f"in one place: drop {flag} to run with {from_config}, or change the launch config.")


def build_dynamo_plugin(compile_mode: str) -> TorchDynamoPlugin:
    """Always an explicit plugin: Accelerator() left without one would read ACCELERATE_DYNAMO_* itself, and compile
    a recipe the rule table was told does not compile."""
    if compile_mode == "none":
        return TorchDynamoPlugin(backend="no")
    # Each torch.compile(module) of regional compilation runs the same wrapper code, and dynamo caches compiled
    # graphs per code object, 8 by default: a tiny GPT-2's leaves (embeddings, norm, head) in train and eval mode
    # passed 8, and the rest ran eager with a warning. The limit only bounds recompiles; it changes no result.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # inductor: torch's default compiler (C++/OpenMP on CPU, Triton on GPU). Regional: the repeated blocks compile
    # once and the other copies reuse the code, so the cold start costs one block, not the whole depth.
    return TorchDynamoPlugin(backend="inductor", use_regional_compilation=compile_mode == "regional")


@dataclass(frozen=True)
class Launch:
    """The run as launched: the flags as typed (`args`, never written to) and, apart from them, every value the
    launch resolved from the flags, the launch config, a DeepSpeed JSON and this machine. The recipe and the core
    read the resolved values here; results.json reports both. Frozen: what a run learns later has its own owner
    (the step count is the recipe's `max_steps`; the preemption handler and --async_checkpoint's writes are objects
    the recipe creates and passes; what a resume changed is shared/core/checkpoint.py's)."""

    args: argparse.Namespace  # as parsed
    recipe: str
    output_dir: str
    mixed_precision: str  # the flag, else the launch config, else the recipe's default (or DeepSpeed's agreed one)
    torch_compile: str  # none | regional | full
    learning_rate: float
    per_device_train_batch_size: int  # the flags' values, or a DeepSpeed JSON's where it sets them
    gradient_accumulation_steps: int
    max_grad_norm: float
    run: rules.Run
    cpu: bool  # Accelerator(cpu=...): gloo DDP on a CPU-only machine
    kwargs_handlers: list = field(default_factory=list)
    log_with: list[str] | None = None
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    dynamo_plugin: TorchDynamoPlugin = field(default_factory=lambda: build_dynamo_plugin("none"))
    resume_from_checkpoint: str | None = None  # the flag, or 'latest' in processes torch elastic restarted
    elastic_restarts: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torch elastic restarted the processes
    # Processes that read different batches, where not all (tensor parallel: dataclasses.replace(launch, ...)).
    data_parallel_size: int | None = None

    def resolved(self) -> dict[str, object]:
        """What the launch resolved, for results.json beside the flags as typed."""
        names = ("recipe", "output_dir", "mixed_precision", "torch_compile", "learning_rate",
                 "per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm",
                 "resume_from_checkpoint", "elastic_restarts")
        return {name: getattr(self, name) for name in names}


_PLAIN_LOOP = rules.Support()  # one process or DDP: what a loop of one's own runs under


def resolve_launch(
    args: argparse.Namespace,
    recipe: str,
    support: rules.Support = _PLAIN_LOOP,
    *,
    deepspeed_config: dict | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    default_mixed_precision: str = "no",
    **asks: object,
) -> Launch:
    """Resolve the launch, and refuse a combination that cannot train, before anything is built or loaded. Pure: it
    reads the flags, the environment and the disk, and changes none of them (the recipe then calls claim_output_dir
    and configure_process).

    `support`: what the recipe runs under (its SUPPORT); the default, a plain loop's (one process or DDP), serves a
    loop of one's own. `args` is left as typed: the resolved values are the returned Launch's. `deepspeed_config` /
    `fsdp_plugin`: the sharding the recipe itself sets up (a DeepSpeed config from
    deepspeed_setup.resolve_deepspeed_config, whose agreed precision, batch, accumulation and clipping the run then
    uses: its SUPPORT's deepspeed steps read them). `asks`: the recipe's techniques as `rules.Run` fields, with
    `flags` saying how the recipe spells them, so a refusal names the user's own flags.
    """
    quiet.silence_known_noise()  # before DeepSpeed, torchao and bitsandbytes are first imported
    check_leftover_accelerate(args)  # before the rule table, which would blame a launch config there is none of
    output_dir = args.output_dir or str(Path("outputs") / f"{recipe}-{args.task}")
    mixed_precision = resolve_mixed_precision(args, default_mixed_precision)
    torch_compile = resolve_compile(args)
    learning_rate = args.learning_rate  # a recipe's own default (parse_args(learning_rate=...)) is not None
    if learning_rate is None:
        learning_rate = PRETRAINED_LR if args.model_name_or_path else FROM_SCRATCH_LR
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    clipping = args.max_grad_norm
    launched, offload, world = rules.launched_sharding(os.environ)
    sharding = launched
    if deepspeed_config is not None:  # the values every source agreed on: the loop runs DeepSpeed's
        sharding, offload, mixed_precision, batch, accumulation, clipping, learning_rate, precision_from = (
            _deepspeed_steps(support, recipe).agreed(deepspeed_config, batch, accumulation, clipping, learning_rate))
        if precision_from:  # for the rule table's messages
            asks["flags"] = {**asks.get("flags", {}), "precision": precision_from}
    elif fsdp_plugin is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy

        sharding, offload = "fsdp", "cpu" if isinstance(fsdp_plugin.cpu_offload, CPUOffloadPolicy) else "none"
    on_cpu = not has_accelerator()
    lone = "WORLD_SIZE" not in os.environ and {"MASTER_ADDR", "ACCELERATE_USE_CPU"} <= os.environ.keys()
    run = rules.Run(recipe=recipe, sharding=sharding, launched=launched, offload=offload, num_processes=world,
                     precision=mixed_precision, on_accelerator=not on_cpu, attention=args.attn_implementation or "",
                     accumulation=accumulation, max_grad_norm=clipping, compile=torch_compile, lone_launch=lone,
                     packing=args.packing if args.task == "causal-lm" or "packing" in args.explicit_flags else
                     "per_document" if args.task == "sft" else "none",  # sft: whole conversations, kept apart
                     parallelism_config=rules.launched_parallelism(os.environ), support=support,
                     async_checkpoint=args.async_checkpoint, weights=args.weights_dtype,
                     preset="" if args.model_name_or_path else args.model_preset, **{"task": args.task, **asks})
    rules.check(run)  # the rule table: refused here, with the reason and the fix
    if sharding == "fsdp" and support.fsdp is None:  # FSDP is a technique: its code comes with the recipe
        raise RecipeError(f"recipes/{recipe}.py runs FSDP but its SUPPORT gives no FSDP steps: pass "
                          "Support(..., fsdp=fsdp_launch.STEPS) (shared/techniques/fsdp_launch.py).")
    if launched == "fsdp" and fsdp_plugin is None:  # the launch config's FSDP settings, checked; the recipe passes it
        fsdp_plugin = support.fsdp.plugin(args)
    deepspeed = _deepspeed_steps(support, recipe) if sharding.startswith("zero") else None
    if deepspeed:
        deepspeed.check_installed()
    check_environment(mixed_precision)
    if not deepspeed:  # under DeepSpeed the variable is the launch config's, resolved with the JSON's
        check_accumulation_variable(accumulation)
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                  "huggingface"))  # datasets and Transformers cache what they load
    there = next(p for p in (home, *home.parents) if p.exists())
    if (args.train_file or args.validation_file or args.dataset_name or args.model_name_or_path) and not (
            there.is_dir() and os.access(there, os.W_OK)):  # (the built-in data and presets need no cache)
        raise LaunchError(f"The Hugging Face cache {home} cannot be written ({there} is not a writable directory). "
                          "Set HF_HOME to a writable directory (export HF_HOME=/tmp/hf_home).")
    log_with = _trackers(args.report_to)
    # Restarted by torch elastic (`--max_restarts N`, a process died): the same command goes on from the newest
    # complete checkpoint; a fresh launch keeps refusing a finished run's directory (docs/multi_node.md).
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Where torch shares the launcher's store with the processes (static rendezvous; c10d unless told not to), a
    # restart's processes read their dead peers' addresses left in it and never connect: refused before any work.
    shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared_store and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        raise LaunchError("--max_restarts: the restarted processes would read their dead peers' addresses in the store "
                          "of the first attempt and fail to connect (Gloo connectFullMesh failed: Connection refused). "
                          "Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv_backend c10d "
                          "(docs/multi_node.md).")
    resume_from = args.resume_from_checkpoint or ("latest" if restarts else None)
    rundir.refuse_inputs(args, output_dir, resume_from)  # the user's model and data are never the output
    # A process that dies or hangs makes the others fail after this long instead of waiting forever.
    process_group = InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))
    cpu = False
    if on_cpu and deepspeed:
        # Without GPUs Accelerate counts one process under DeepSpeed unless the process group is gloo.
        process_group.backend = "gloo"
    elif on_cpu and world > 1:
        if sharding == "fsdp":
            # Accelerate never enables FSDP without GPUs (the replicas would train unsynced): start a gloo group
            # here and force FSDP2 once the Accelerator exists (start_run, shared/techniques/fsdp_launch.py).
            process_group.backend = "gloo"
        else:
            # A MULTI_GPU config with `use_cpu: true` gives real gloo DDP only with cpu=True in the script;
            # without it every process reports DistributedType.NO and trains its own unsynced copy.
            cpu = True
    return Launch(args=args, recipe=recipe, output_dir=output_dir, mixed_precision=mixed_precision,
                  torch_compile=torch_compile, learning_rate=learning_rate, per_device_train_batch_size=batch,
                  gradient_accumulation_steps=accumulation, max_grad_norm=clipping, run=run, cpu=cpu,
                  kwargs_handlers=[process_group], log_with=log_with, fsdp_plugin=fsdp_plugin,
                  dynamo_plugin=build_dynamo_plugin(torch_compile), resume_from_checkpoint=resume_from,
                  elastic_restarts=restarts)


def _deepspeed_steps(support: rules.Support, recipe: str) -> object:
    if support.deepspeed is None:  # DeepSpeed is a technique: its code comes with the recipe
        raise RecipeError(f"recipes/{recipe}.py runs DeepSpeed but its SUPPORT gives no DeepSpeed steps: pass "
                          "Support(..., deepspeed=deepspeed_setup.STEPS) (shared/techniques/deepspeed_setup.py).")
    return support.deepspeed


def claim_output_dir(launch: Launch) -> None:
    """Right after resolve_launch, whose checks all come first: --overwrite_output_dir removes the old run, which a
    refusal must not have cost. The main process takes the output directory: one run per directory (rundir.claim)."""
    if os.environ.get("RANK", "0") == "0":
        rundir.claim(launch.args, launch.output_dir, launch.resume_from_checkpoint)


def configure_process(launch: Launch) -> None:
    """Right after resolve_launch, before Accelerator(...): what this process's environment needs for the launch."""
    check_leftover_rendezvous(launch.args)  # last before Accelerator(...), which would wait for the peers
    # Two processes on two cores with torch's default thread count oversubscribe the CPU: a 3 s run took 83 s.
    if not launch.run.on_accelerator and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if launch.run.sharding.startswith("zero"):
        launch.run.support.deepspeed.configure_process()  # a lone process's rendezvous variables


def start_run(accelerator: Accelerator, launch: Launch) -> None:
    """Right after Accelerator(...): check that Accelerate resolved what was launched, make fp16 real on CPU, and
    start logging, seeding and trackers."""
    run = launch.run
    if not has_accelerator() and run.num_processes > 1 and run.sharding == "fsdp":
        run.support.fsdp.force_on_cpu(accelerator, launch.fsdp_plugin)
    if accelerator.num_processes != run.num_processes:
        raise LaunchError(
            f"{run.num_processes} processes were launched but Accelerate sees {accelerator.num_processes} "
            f"(distributed_type={accelerator.distributed_type}): the processes would train unsynced copies. "
            "On a CPU-only machine use accelerate_configs/multi_cpu.yaml (MULTI_GPU with use_cpu: true)."
        )
    if rules.sharding_of(accelerator) != run.sharding:
        # E.g. `use_cpu: true` in a DeepSpeed accelerate config turns DeepSpeed off: not the run that was asked for.
        raise LaunchError(
            f"recipes/{run.recipe}.py was checked as a {run.sharding} run, but Accelerate resolved "
            f"{rules.sharding_of(accelerator)} (distributed_type={accelerator.distributed_type.value}). Use a "
            "launch config of that kind (accelerate_configs/), with `use_cpu: false` for DeepSpeed."
        )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # (under DeepSpeed: refused)
        _enable_cpu_fp16(accelerator)

    args = launch.args
    set_seed(args.seed)
    if launch.log_with:
        config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                  for k, v in {**vars(args), **launch.resolved()}.items()}
        try:
            accelerator.init_trackers(run.recipe, config=config)
        except OSError as err:  # a full disk (ENOSPC), a read-only one: named before any step
            raise CheckpointError(f"--report_to {args.report_to}: the trackers could not start writing in "
                                  f"{launch.output_dir} ({err.strerror or err}: {err.filename}). Free space there "
                                  "or make it writable, pass another --output_dir, or --report_to none.") from None
    if not args.mixed_precision and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
        logger.info("mixed_precision=%s from ACCELERATE_MIXED_PRECISION (the launch config)",
                    os.environ["ACCELERATE_MIXED_PRECISION"])
    logger.info(
        "%s: task=%s distributed_type=%s processes=%d device=%s mixed_precision=%s output_dir=%s",
        run.recipe, args.task, accelerator.distributed_type.value, accelerator.num_processes,
        accelerator.device, accelerator.mixed_precision, launch.output_dir,
    )


# Variables only a launcher sets: torchrun (and `accelerate launch` of several processes), `accelerate launch` of one
# (ACCELERATE_DYNAMO_MODE) or of DeepSpeed (its zero stage beside ACCELERATE_CONFIG_DS_FIELDS, which
# deepspeed_setup removes), schedulers' own launchers, and our own lone-process DeepSpeed set-up (deepspeed_setup).
# Without one of them, launch variables are leftovers of a shell.
_LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_CONFIG_DS_FIELDS",
                   "ACCELERATE_DEEPSPEED_ZERO_STAGE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                   "RECIPES_OWN_RENDEZVOUS")
_RENDEZVOUS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_launcher(env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    return any(mark in env for mark in _LAUNCHER_MARKS)


def check_leftover_accelerate(args: argparse.Namespace) -> None:
    """A plain `python recipes/x.py` in a shell that kept ACCELERATE_* variables (an `export`, a notebook's
    os.environ) would run what they say, not what was typed: the sharding ones are refused naming the variable, and
    a mixed precision the flags did not ask for too. Under `accelerate launch` they are the launch config's."""
    env = os.environ
    if launched_by_launcher(env) or "WORLD_SIZE" in env:  # (WORLD_SIZE alone: check_leftover_rendezvous)
        return
    set_vars = [f"{k}={env[k]}" for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
                if env.get(k, "false").lower() in ("1", "true", "yes")]
    if set_vars:
        raise LaunchError(f"{', '.join(set_vars)} is set in the environment, and no launcher started this run: a "
                          "leftover of an export or an earlier launch, which would make Accelerate shard this "
                          f"process. `unset {' '.join(v.split('=')[0] for v in set_vars)}`, or start the run with "
                          "accelerate launch --config_file accelerate_configs/<config>.yaml.")
    mp = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mp != "no" and not args.mixed_precision:
        raise LaunchError(f"ACCELERATE_MIXED_PRECISION={mp} is set in the environment, and no launcher started this "
                          f"run: it would compute in {mp} although no flag asked for it. Pass --mixed_precision {mp} "
                          "to ask for it, or `unset ACCELERATE_MIXED_PRECISION` for the recipe's own precision.")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend != "no" and not args.torch_compile:  # resolve_compile would take it as the launch config's
        raise LaunchError(f"ACCELERATE_DYNAMO_BACKEND={backend} is set in the environment, and no launcher started "
                          "this run: the model would be compiled although no flag asked for it. Pass --torch_compile "
                          "full (or regional) to ask for it, or `unset ACCELERATE_DYNAMO_BACKEND` to run eager.")


def check_accumulation_variable(accumulation: int) -> None:
    """ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which `accelerate launch` sets for DeepSpeed configs only: a run not
    under DeepSpeed that finds it was left it by a shell, and Accelerate would divide every loss by it in backward()
    (Accelerator() reads it when no plugin is passed), or the run would say one accumulation and Accelerate hold
    another."""
    value = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if value in (None, "", str(accumulation)):
        return
    raise LaunchError(f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={value} is set in the environment (accelerate launch "
                      "sets it for DeepSpeed configs only: a leftover of an export or an earlier launch), and this run "
                      f"accumulates {accumulation}: Accelerate would divide every loss by {value}. `unset "
                      "ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, or pass --gradient_accumulation_steps "
                      f"{value} to a recipe that accumulates (recipes/gradient_accumulation.py).")


def check_leftover_rendezvous(args: argparse.Namespace) -> None:
    """WORLD_SIZE, RANK, MASTER_ADDR ... left in a shell make a plain run wait for peers that never come (the whole
    --ddp_timeout), or fail inside Accelerate: refused at once, naming them."""
    env = os.environ
    left = [f"{k}={env[k]}" for k in _RENDEZVOUS if k in env]
    if left and not launched_by_launcher(env):
        raise LaunchError(f"{', '.join(left)} {'is' if len(left) == 1 else 'are'} set in the environment, and no "
                          "launcher started this run: leftovers of an export or another launcher's shell. This "
                          f"process would wait for peers that never start (up to --ddp_timeout {args.ddp_timeout} s). "
                          f"`unset {' '.join(v.split('=')[0] for v in left)}`, or start the processes with accelerate "
                          "launch (or torchrun).")


def check_environment(mixed_precision: str) -> None:
    """What this machine cannot do, refused at start-up with the fix."""
    if mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise LaunchError(f"--mixed_precision bf16: {torch.cuda.get_device_name()} has no bf16 support. "
                          "Use --mixed_precision fp16 (dynamic loss scaling), or fp32.")


def _trackers(report_to: str | None) -> list[str] | None:
    """The trackers named by --report_to; Accelerate would drop a missing one with a mere warning."""
    if report_to in ("none", "", None):
        return None
    import difflib

    from accelerate.utils import LoggerType

    from .accelerate_compat import available_trackers

    names = [t.strip() for t in report_to.split(",") if t.strip()]
    known = [t.value for t in LoggerType]
    available = {str(t.value) for t in available_trackers()}
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            raise LaunchError(f"--report_to {name}: not a tracker Accelerate knows. "
                              + (f"Did you mean {near[0]}? " if near else "")
                              + f"Pick from {known[1:]} or 'none'.")
    missing = [n for n in names if n != "all" and n not in available]
    if missing:
        packages = " ".join(_TRACKER_PACKAGES.get(n, n) for n in missing)
        raise LaunchError(f"--report_to {','.join(missing)}: not installed. `pip install {packages}`, "
                          f"or pick from the installed trackers {sorted(available)} or 'none'.")
    return names


_TRACKER_PACKAGES = {"comet_ml": "comet-ml"}  # the pip name, where it differs from the tracker's


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enable_cpu_fp16(accelerator: Accelerator) -> None:
    # Accelerate leaves fp16 on CPU silently fp32 (no autocast, no scaler): the losses are bit-identical to fp32.
    # torch's CPU fp16 autocast and GradScaler("cpu") do work (overflow skips and back-off observed), so we turn
    # on what Accelerate does on GPUs. It must happen before prepare(): prepare_model wraps forward in autocast
    # when native_amp is set, and prepare_optimizer hands the scaler to the optimizer wrapper.
    from .accelerate_compat import enable_cpu_fp16

    kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
    enable_cpu_fp16(accelerator, torch.amp.GradScaler("cpu", **kwargs))
