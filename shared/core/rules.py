"""The rule table: which recipe, launch config and flags train together; the others refused before anything
loads (`check(run)`; `check_built` for facts of the built model), with the reason and a fix in the recipe's own
flag names. Each rule was found by running the combination (benchmarks/compat_sweep.py, tests/test_launch_grid.py):
it replaces a crash deep inside a library, or a run that would silently train something other than was asked.

Here: the machinery, and the rules any recipe can meet (launch, sharding, process count, precision, the common
flags), which read what the running recipe says it runs under: its `SUPPORT = Support(...)`, beside `RECIPE` in
recipes/<name>.py, passed to resolve_launch and held on the Run (shared/tools/catalogue.py gathers every recipe's,
for the tools and tests). A technique's own rules live in its module (shared/techniques/*.py), which adds them with
`register(...)` when imported, with the `Run` fields they read."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .args import DECODER_TASKS, DECODERS, OPTIMIZERS
from .errors import LaunchError

SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
OFFLOADS = ("none", "cpu", "nvme")  # where the offloaded state goes (DeepSpeed's device words)
TORCHAO_OPTIMIZERS = tuple(name for name, library in OPTIMIZERS.items() if library == "torchao")  # --optim
_CLASSIC = ("none", "ddp")  # one process, or DDP replicas: what a recipe that shows no sharding runs under


@dataclass(frozen=True)
class Support:
    """What a recipe implements: the shardings it runs under, and the launches it needs."""

    shardings: tuple[str, ...] = _CLASSIC
    accumulates: bool = False  # its loop uses accelerator.accumulate
    min_processes: int = 1
    max_processes: int | None = None
    needs_offload: bool = False
    instead: str = ""  # where to go for the shardings it does not run
    why_not: str = ""  # why it cannot run the others, where that is more than "it would crash"
    own_attention_mask: bool = False  # its pipeline stages run the blocks with a plain causal mask
    precision: str = ""  # the one mixed precision it trains in ("": whichever the flag or launch config says)
    # --torch_compile: the model goes through accelerator.prepare(), which compiles it (regional or full) after DDP /
    # FSDP2 / activation checkpointing; tests/test_compile.py. Others say why not in `no_compile`.
    compiles: bool = False
    no_compile: str = ""
    splits_sequence: bool = False  # each process holds a chunk of every sequence (sequence parallel)
    no_fp16: str = ""  # why it refuses fp16 ("": it takes it)
    needs_trained_model: bool = False  # it starts from a trained model (--model_name_or_path), never a fresh preset
    reshards: bool = False  # its checkpoints resume on another process count (docs/resharding.md)
    async_checkpoint: bool = False  # its checkpoints are DCP shards, which async_save writes in the background
    # A recipe that trains under FSDP hands the spine its FSDP steps (shared/techniques/fsdp_launch.py STEPS: the
    # launch config's settings checked, FSDP2 on CPU, one unit per block); the others carry none of that code.
    fsdp: object | None = None
    # Likewise DeepSpeed's (shared/techniques/deepspeed_setup.py STEPS: a resolved config's agreed settings, the
    # install check, a lone process's rendezvous), and its rules, which that module registers.
    deepspeed: object | None = None


# The recipes a refusal points to: the ones that compile, and the ones whose checkpoints are DCP shards (each
# recipe's SUPPORT says it of itself; tests/test_rules.py holds these to them).
COMPILING = ("baseline", "mixed_precision", "gradient_accumulation", "activation_checkpointing", "data_parallel")
ASYNC_CHECKPOINTING = ("tensor_parallel", "expert_parallel", "fsdp")


@dataclass(frozen=True, init=False)
class Run:
    """What one run asks for, in the table's words. `flags` says how this recipe spells each field, for messages.

    The fields below are the ones every recipe has; a technique's own (comm_hook, microbatches, heads, ...) are
    declared by its module's `register(fields=...)` and kept in `extra`: `run.comm_hook` reads them the same way,
    with the registered default when not given."""

    recipe: str
    sharding: str  # what the recipe will run: none | ddp | zero1 | zero2 | zero3 | fsdp
    launched: str  # what the launch config asked for (the same words)
    offload: str = "none"  # none | cpu | nvme: where the launch offloads to (OFFLOADS)
    num_processes: int = 1
    precision: str = "no"
    on_accelerator: bool = True
    lone_launch: bool = False  # MASTER_ADDR, no WORLD_SIZE: `accelerate launch` asked for N, started this one
    attention: str = ""  # --attn_implementation ("": Transformers' choice)
    accumulation: int = 1
    # an --optim name (shared/core/args.py OPTIMIZERS), or adamw_in_backward (each parameter stepped in its hook)
    optimizer: str = "adamw"
    max_grad_norm: float = 0.0  # global-norm clipping (0: none)
    parallelism_config: str = ""  # Accelerate's ParallelismConfig from the launch config, e.g. "tp=2 cp=2" ("": none)
    packing: str = "none"  # causal LM: concat | per_document | none (shared/tasks/packing.py)
    compile: str = "none"  # torch.compile through Accelerate's TorchDynamoPlugin: none | regional | full
    task: str = ""  # text-classification | causal-lm | image-classification | sft ("": not checked)
    async_checkpoint: bool = False  # --async_checkpoint: checkpoints written in the background
    model_given: bool = True  # --model_name_or_path was passed (False: the recipe's own fresh preset)
    preset: str = ""  # --model_preset when no --model_name_or_path is given ("": a given model)
    weights: str = "fp32"  # --weights_dtype: fp32 | bf16 | auto
    no_router_loss: str = ""  # built: the MoE model class of the task that returns no router aux_loss ("": none)
    support: Support | None = None  # the recipe's SUPPORT (what it runs under), read by the generic rules
    flags: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, object] = field(default_factory=dict)  # the techniques' fields (FIELDS), as given

    def __init__(self, recipe: str, sharding: str, launched: str, *, extra: Mapping[str, object] | None = None,
                 **given: object) -> None:
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = {"recipe": recipe, "sharding": sharding, "launched": launched}.get(f.name, dataclasses.MISSING)
            if value is dataclasses.MISSING:
                value = given.pop(f.name) if f.name in given else (
                    f.default if f.default is not dataclasses.MISSING else f.default_factory())
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "extra", {**(extra or {}), **given})

    def __getattr__(self, name: str) -> object:  # only for names that are not core fields
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        if name in FIELDS:
            return FIELDS[name]
        raise AttributeError(f"Run has no field {name!r} (no imported technique registered it)")

    def flag(self, name: str) -> str:
        return self.flags.get(name, f"--{name}")

    @property
    def sharded_params(self) -> bool:
        return self.sharding in ("zero3", "fsdp")


@dataclass(frozen=True)
class Rule:
    applies: Callable[[Run], bool]
    reason: Callable[[Run], str]  # the problem, naming the run's own flags
    fix: Callable[[Run], str]
    built: bool = False  # reads facts known once the model or the Accelerator is built (check_built)


def launch_words(run: Run) -> str:
    return {"none": "one process", "ddp": f"{run.num_processes} processes of plain data parallel",
            "fsdp": "FSDP"}.get(run.launched, f"DeepSpeed ZeRO-{run.launched[-1]}")


def _kind(sharding: str) -> str:
    return "zero" if sharding.startswith("zero") else sharding


def _processes(n: int) -> str:
    return "1 was" if n == 1 else f"{n} were"


def unsplit(r: Run, degree: int, **sizes: int) -> str:
    """The first of `sizes` that `degree` does not divide, in words ("": all split)."""
    words = {"heads": "attention heads", "kv_heads": "key/value heads", "mlp_width": "MLP width", "experts": "experts"}
    return next((f"{words[k]} ({v})" for k, v in sizes.items() if v and v % degree), "")


FIELDS: dict[str, object] = {}  # the techniques' Run fields and their defaults (register)
RULES: list[Rule] = [
    Rule(lambda r: _kind(r.launched) in ("zero", "fsdp") and _kind(r.sharding) != _kind(r.launched),
         lambda r: f"the launch config asks for {launch_words(r)}, and recipes/{r.recipe}.py runs "
                   f"{'DeepSpeed' if _kind(r.sharding) == 'zero' else 'FSDP'} itself",
         lambda r: "launch it with a plain config (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml) or one of "
                   f"its own kind ({r.support.instead})"),
    # A distributed_type no recipe implements (Megatron-LM is its own engine: Accelerator() would fail importing it).
    Rule(lambda r: r.launched == "megatron",
         lambda r: "the launch config's distributed_type is MEGATRON_LM: Megatron-LM's engine is not wired into these "
                   "recipes",
         lambda r: "use a plain config (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml) with recipes/"
                   "tensor_parallel.py, pipeline_parallel.py or data_model_parallel.py for its parallelisms"),
    Rule(lambda r: r.sharding not in r.support.shardings and r.launched != "megatron",
         lambda r: f"recipes/{r.recipe}.py does not implement {launch_words(r)}, which the launch config asks for; "
                   f"{r.support.why_not or 'it would crash or train something else'}",
         lambda r: f"use {r.support.instead}"),
    Rule(lambda r: r.num_processes < r.support.min_processes,
         lambda r: f"recipes/{r.recipe}.py needs at least {r.support.min_processes} processes, and "
                   f"{_processes(r.num_processes)} launched",
         lambda r: f"launch it with {r.support.instead}"),
    Rule(lambda r: (r.support.max_processes or r.num_processes) < r.num_processes,
         lambda r: f"recipes/{r.recipe}.py runs in one process that drives all its devices, and "
                   f"{_processes(r.num_processes)} launched",
         lambda r: f"use {r.support.instead}"),
    Rule(lambda r: r.support.needs_offload and r.offload == "none",
         lambda r: f"recipes/{r.recipe}.py shows offload, and the launch config offloads nothing",
         lambda r: f"use {r.support.instead}, or recipes/zero.py for ZeRO without offload"),
    # Accelerate takes fp8 from any launch config, and a model without nn.Linear blocks (GPT-2's Conv1D) then trains
    # in bf16 under an fp8 label: only recipes/fp8.py checks what was converted.
    Rule(lambda r: r.precision == "fp8" and r.support.precision != "fp8",
         lambda r: f"mixed precision 'fp8' (from the launch config): recipes/{r.recipe}.py does not check what fp8 "
                   "converts, and a model whose blocks are not nn.Linear would train in bf16 under an fp8 label",
         lambda r: "use recipes/fp8.py, or mixed_precision bf16 in the launch config"),
    Rule(lambda r: r.support.precision not in ("", r.precision),
         lambda r: f"mixed precision {r.precision!r} (from --mixed_precision or the launch config): "
                   f"recipes/{r.recipe}.py trains in {r.support.precision} only",
         lambda r: "drop --mixed_precision and use a launch config with mixed_precision 'no' (accelerate_configs/"
                   "single_process.yaml, multi_cpu.yaml), or recipes/mixed_precision.py for fp16 / bf16"),
    Rule(lambda r: r.compile != "none" and not r.support.compiles,
         lambda r: f"--torch_compile {r.compile} (the flag or the launch config's dynamo_config): "
                   f"recipes/{r.recipe}.py does not compile its model: "
                   f"{r.support.no_compile or 'it has not been run compiled here'}",
         lambda r: "drop --torch_compile (and set dynamo_backend: NO in the launch config), or use a recipe that "
                   "compiles: " + ", ".join(f"recipes/{n}.py" for n in COMPILING)),
    Rule(lambda r: r.async_checkpoint and not r.support.async_checkpoint,
         lambda r: f"--async_checkpoint: recipes/{r.recipe}.py writes its checkpoints with torch.save / safetensors "
                   "(or DeepSpeed's own writer), not torch.distributed.checkpoint, whose async_save is what writes "
                   "one in the background",
         lambda r: "drop --async_checkpoint, or use a recipe whose checkpoints are DCP shards: " + ", ".join(
             f"recipes/{n}.py" for n in ASYNC_CHECKPOINTING)),
    Rule(lambda r: r.accumulation > 1 and not r.support.accumulates and r.optimizer != "adamw_in_backward"
         and not getattr(r, "in_backward", False) and not getattr(r, "microbatches", 0),
         lambda r: f"--gradient_accumulation_steps {r.accumulation}: recipes/{r.recipe}.py does not accumulate "
                   "gradients (Accelerate would still divide every loss by it)",
         lambda r: "use recipes/gradient_accumulation.py or recipes/zero.py, or drop the flag"),
    Rule(lambda r: "tp=" in r.parallelism_config and r.launched == "fsdp",
         lambda r: f"the launch config's ParallelismConfig ({r.parallelism_config}) under FSDP: Accelerate 1.15 "
                   "imports transformers' ReplicateParallel for TP x FSDP2, which transformers 5.24 lacks",
         lambda r: "drop parallelism_config from the launch config and use recipes/tensor_parallel.py --tp_size N "
                   "with accelerate_configs/tp2_dp2.yaml"),
    # docs/tensor_parallel.md: Accelerate 1.15 refuses CPU distributed types when it validates
    # a ParallelismConfig, and torch's context_parallel has no sharding strategy for sdpa's CPU flash kernel.
    Rule(lambda r: bool(r.parallelism_config) and not r.on_accelerator,
         lambda r: f"the launch config sets Accelerate's ParallelismConfig ({r.parallelism_config}) on a CPU-only "
                   "machine: Accelerate refuses CPU distributed types when it validates it"
                   + ("; and torch's context parallel has no sharding strategy for sdpa on CPU "
                      "(aten._scaled_dot_product_flash_attention_for_cpu)" if "cp=" in r.parallelism_config else ""),
         lambda r: "drop parallelism_config from the launch config and use recipes/tensor_parallel.py --tp_size N "
                   "(the same TP x FSDP2 mesh, built with torch's init_device_mesh) with accelerate_configs/"
                   "tp2_dp2.yaml; for long sequences on CPU, DeepSpeed's Ulysses sequence parallel; HSDP: "
                   "recipes/fsdp.py --dp_replicate_size R (Accelerate's ParallelismConfig, run on gloo too)"),
    Rule(lambda r: r.lone_launch,
         lambda r: "accelerate launch was asked for several processes and started this one alone: without GPUs it "
                   "does so for --num_processes N without a config, for --cpu, and for `distributed_type: MULTI_CPU`",
         lambda r: "add --multi_gpu to `accelerate launch` (not --cpu: the recipe runs gloo DDP on a CPU-only "
                   "machine), or use --config_file accelerate_configs/multi_cpu.yaml (MULTI_GPU with use_cpu: true)"),
    Rule(lambda r: r.attention.startswith("flash_attention") and not r.on_accelerator,
         lambda r: f"--attn_implementation {r.attention} runs on CUDA GPUs only, and this machine has none",
         lambda r: "pass --attn_implementation sdpa (or eager), or leave it unset"),
    Rule(lambda r: r.packing == "per_document" and r.support.own_attention_mask,
         lambda r: f"--packing per_document: recipes/{r.recipe}.py runs the model through its own pipeline stages, "
                   "whose plain causal mask would let packed documents attend to each other",
         lambda r: "use --packing none with it" if r.task == "sft" else "use --packing concat or --packing none"),
    Rule(lambda r: r.task not in ("", *DECODER_TASKS) and r.packing != "none",
         lambda r: f"--packing {r.packing} with --task {r.task}: it packs causal-LM documents, so it would do nothing",
         lambda r: "drop --packing, or pass --task causal-lm"),
    Rule(lambda r: r.task == "sft" and r.packing == "concat",
         lambda r: "--packing concat with --task sft: conversations would be joined, cut mid-answer, and attend to "
                   "each other",
         lambda r: "drop --packing (per_document: whole conversations packed, each attending to itself) or pass "
                   "--packing none"),
    # Accelerate's FSDP2 mixed precision upcasts the sharded parameters: pure bf16 would not be what ran (DeepSpeed's
    # rule: shared/techniques/deepspeed_setup.py).
    Rule(lambda r: r.weights == "bf16" and r.sharding == "fsdp" and r.precision != "no",
         lambda r: f"--weights_dtype bf16 (pure bf16) under {launch_words(r)} with mixed precision: it keeps fp32 "
                   "master weights of its own, so the weights would not train in bf16",
         lambda r: "pass --weights_dtype fp32 (fp32 masters, which this sharding keeps anyway), or --mixed_precision "
                   "no for pure bf16 under FSDP2"),
    Rule(lambda r: bool(r.support.no_fp16) and r.precision == "fp16",
         lambda r: f"fp16 with recipes/{r.recipe}.py: {r.support.no_fp16}",
         lambda r: "use --mixed_precision bf16 or no"),
    Rule(lambda r: r.support.needs_trained_model and not r.model_given,
         lambda r: f"recipes/{r.recipe}.py quantizes a trained model, and no --model_name_or_path was passed (a "
                   "fresh preset has learned nothing to keep)",
         lambda r: "pass --model_name_or_path (e.g. the output_dir of recipes/baseline.py)"),
]
# The model presets' rules: read after a technique's own launch-time reasons, before the built facts' rules.
_PRESETS = [
    Rule(lambda r: r.preset in DECODERS and r.task == "image-classification",
         lambda r: f"--model_preset {r.preset} is a decoder for text (Llama / Mixtral style), and --task "
                   "image-classification needs an image model",
         lambda r: "pass --task causal-lm or text-classification, or --model_preset tiny (ViT) for images"),
    # Any source of the model (a preset, a directory, a hub id): read from its config in load_task.
    Rule(lambda r: bool(r.no_router_loss),
         lambda r: f"the model is a mixture of experts, and Transformers' {r.no_router_loss} (--task {r.task}) "
                   "returns no router aux_loss, so the router's load-balancing loss would silently not train",
         lambda r: "use --task causal-lm for the mixture of experts, or a dense model (--model_preset tiny-llama) to "
                   "classify text", built=True),
    Rule(lambda r: r.preset in ("tiny-moe", "tiny-qwen3-moe") and r.packing == "per_document",
         lambda r: f"--model_preset {r.preset} with --packing per_document: Transformers' MoE load-balancing loss "
                   "reads the attention mask as a 2-D padding mask, and per-document packing passes a 4-D block mask "
                   "(it fails: 'The size of tensor a (256) must match the size of tensor b (16384)')",
         lambda r: "pass --packing none" + (" (or concat)" if r.task == "causal-lm" else "")),
]
RULES += _PRESETS


def register(*rules: Rule, fields: Mapping[str, object] | None = None, first: bool = False, late: bool = False
             ) -> None:
    """Add a technique's rules to the table, once: after the generic ones and before the presets' (`first`: ahead
    of all, for a more specific reason; `late`: after the presets'; built ones: last); and the Run fields they
    read, with their defaults. Where several rules refuse a run, the message reads them in this order."""
    for name, default in (fields or {}).items():
        if FIELDS.setdefault(name, default) != default:
            raise ValueError(f"Run field {name!r} registered with two defaults: {FIELDS[name]!r} and {default!r}")
    for i, rule in enumerate(rule for rule in rules if rule not in RULES):
        built = next((j for j, old in enumerate(RULES) if old.built), len(RULES))
        RULES.insert(i if first else len(RULES) if rule.built else built if late else RULES.index(_PRESETS[0]), rule)


def refusals(run: Run) -> list[str]:
    """Every rule the run breaks, as 'problem. Fix: ...' sentences (empty: it trains)."""
    if run.support is None:
        return [f"recipes/{run.recipe}.py passed no Support to resolve_launch. Fix: declare SUPPORT = Support(...) "
                "beside RECIPE and pass it: resolve_launch(args, RECIPE, SUPPORT)."]
    unknown = sorted(run.extra.keys() - FIELDS.keys())
    if unknown:  # a technique's fields, and its module (its rules) not imported
        raise TypeError(f"Run fields no imported technique registered: {unknown}")
    found = [(rule.reason(run), rule.fix(run)) for rule in RULES if rule.applies(run)]
    return [f"{reason}. Fix: {fix[0].upper()}{fix[1:]}." for reason, fix in found]


def check(run: Run) -> None:
    """Stop (SystemExit) before anything is loaded when the run breaks a rule."""
    found = refusals(run)
    if found:
        raise LaunchError("Refused before training: " + " ".join(found))


def built_refusals(run: Run) -> list[str]:
    """The rules on built facts (Rule.built) that the run breaks, as refusals() words them."""
    found = [(rule.reason(run), rule.fix(run)) for rule in RULES if rule.built and rule.applies(run)]
    return [f"{reason}. Fix: {fix[0].upper()}{fix[1:]}." for reason, fix in found]


def check_built(recipe: str = "", **facts: object) -> None:
    """Stop (SystemExit) on what only shows once the model or the Accelerator is built, by the same table: the
    technique gathers the facts (Run fields: model_type=..., heads=...), the rules decide. The launch itself was
    checked by check(); only the rules that read built facts are weighed here."""
    found = built_refusals(Run(recipe=recipe, sharding="none", launched="none", **facts))
    if found:
        raise LaunchError("Refused before training: " + " ".join(found))


# ---------------------------------------------------------------- the launch, as `accelerate launch` described it


def _env_true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").lower() in ("1", "true", "yes")


def launched_parallelism(env: Mapping[str, str] = os.environ) -> str:
    """Accelerate's ParallelismConfig sizes above 1 that the launch config set, e.g. "tp=2 cp=2" ("": none)."""
    if not _env_true(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return ""
    sizes = {k: int(env.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1"))
             for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    return " ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "all sizes 1"


def offload_word(devices: set[str]) -> str:
    """none | cpu | nvme: the furthest place the devices (DeepSpeed's words, per offloaded part) send state to."""
    return "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"


def zero_offload(zero: Mapping) -> str:
    """offload_word of a DeepSpeed config's zero_optimization block (its optimizer's and parameters' devices)."""
    return offload_word({(zero.get(p) or {}).get("device", "none") for p in ("offload_optimizer", "offload_param")})


def launched_sharding(env: Mapping[str, str] = os.environ) -> tuple[str, str, int]:
    """(sharding, offload, processes) the launch config asked for, from the variables `accelerate launch` sets."""
    world = int(env.get("WORLD_SIZE", "1"))
    if _env_true(env, "ACCELERATE_USE_DEEPSPEED"):
        devices = {env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{p}_DEVICE", "none").lower() for p in ("OPTIMIZER", "PARAM")}
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}", offload_word(devices), world
    if _env_true(env, "ACCELERATE_USE_FSDP"):
        return "fsdp", "cpu" if _env_true(env, "FSDP_OFFLOAD_PARAMS") else "none", world
    if _env_true(env, "ACCELERATE_USE_MEGATRON_LM"):
        return "megatron", "none", world
    return ("ddp" if world > 1 else "none"), "none", world


def sharding_of(accelerator) -> str:
    """none | ddp | zero1 | zero2 | zero3 | fsdp: how a built Accelerator spreads the model state (for results)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return "fsdp"
    return "ddp" if accelerator.num_processes > 1 else "none"


def offload_of(accelerator) -> str:
    """none | cpu | nvme, as a built Accelerator runs it (for results)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return zero_offload(accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}))
    if kind == DistributedType.FSDP:
        from torch.distributed.fsdp import CPUOffloadPolicy

        return "cpu" if isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy) else "none"
    return "none"


def offload_params_of(accelerator) -> bool:
    """Whether the parameters are offloaded too, beside the optimizer state (ZeRO-3's offload_param, FSDP's
    offload_params): what tells the planner's zero2_offload-like rows from its zero3_offload-like ones."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        return (zero.get("offload_param") or {}).get("device", "none") != "none"
    return offload_of(accelerator) != "none"  # FSDP offloads the parameters (and all that lives with them)
