"""The one rule table: which recipe, launch config and flags train together; the others refused before anything
loads (`check(run)`; `check_built` for facts of the built model), with the reason and a fix in the recipe's own
flag names. Each rule was found by running the combination (benchmarks/compat_sweep.py, tests/test_launch_grid.py):
it replaces a crash deep inside a library, or a run that would silently train something other than was asked."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .args import OPTIMIZERS

SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
OFFLOADS = ("none", "cpu", "nvme")  # where the offloaded state goes (DeepSpeed's device words)
LOAD_IN = ("full", "8bit", "4bit")  # base weights: full precision, or quantized by bitsandbytes (--load_in)
TORCHAO_OPTIMIZERS = tuple(name for name, library in OPTIMIZERS.items() if library == "torchao")  # --optim
_CLASSIC = ("none", "ddp")  # one process, or DDP replicas: what a recipe that shows no sharding runs under
_ZERO = ("zero1", "zero2", "zero3")


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
    # The catalogue beyond this table. The memory planner (shared/tools/plan.py) has rows of its own for a recipe,
    # or models it as the recipe named in `plans_as`, or says in `not_planned` why it has no model of it.
    plans_as: str = ""
    not_planned: str = ""
    # Lines `diff recipes/baseline.py recipes/<name>.py` may add or remove (tests/test_recipe_shape.py): the recipe
    # shows its technique and little else. Measured 2026-12-01, plus about 10% (at least 4) for small edits.
    diff_budget: int = 0
    async_checkpoint: bool = False  # its checkpoints are DCP shards, which async_save writes in the background


_NO = {  # --torch_compile: why these recipes refuse it (the others: not run compiled here yet)
    "model_parallel": ("its model is left out of accelerator.prepare() (it places the blocks over the devices itself), "
                       "so nothing would compile it"),
    "pipeline_parallel": ("its stages run through torch.distributed.pipelining, outside accelerator.prepare(), so "
                          "nothing would compile them"),
    "data_model_parallel": ("its stages run through torch.distributed.pipelining, outside accelerator.prepare(), so "
                            "nothing would compile them"),
    "tensor_parallel": ("its blocks are split with parallelize_module outside accelerator.prepare(), so nothing would "
                        "compile them (DTensor blocks under inductor were not run here)"),
    "expert_parallel": ("its model is distributed by Transformers' expert-parallel and FSDP2 plans outside "
                        "accelerator.prepare(), so nothing would compile it (all-to-all dispatch under inductor was "
                        "not run here)"),
    "zero": ("under DeepSpeed, Accelerate compiles the engine's module in place (engine.compile), which has not been "
             "run on this stack"),
    "zero3_offload": ("under DeepSpeed, Accelerate compiles the engine's module in place (engine.compile), which has "
                      "not been run on this stack"),
}
_NOT_PLANNED = {  # why shared/tools/plan.py has no rows for these
    "pruning": "its masks and the pruning schedule's state are not modelled",
    "qat": "the fake-quantized weights and their observers are not modelled",
    "ptq": "it does not train: it quantizes a trained model for serving",
    "model_parallel": "one model spread over several devices by one process is not modelled",
    "pipeline_parallel": "pipeline stages (each device's blocks and its micro-batches in flight) are not modelled",
    "fp8": "FP8 weights, activations and scales (torchao's Float8Linear) are not modelled",
    "expert_parallel": "experts split over the processes (each holds 1/N of them, tokens exchanged by all-to-all) "
                       "and the routed tokens per expert are not modelled",
}
_SHARDED = "recipes/zero.py (ZeRO), recipes/fsdp.py (FSDP) or recipes/combined.py (this technique with sharding)"
_ONE_OR_DDP = "a single process or DDP (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml)"
RECIPES: dict[str, Support] = {
    "baseline": Support(compiles=True, instead=_SHARDED, reshards=True),
    "mixed_precision": Support(compiles=True, instead=_SHARDED, diff_budget=41),
    # Accumulation keeps one micro-batch's activations at a time; DDP replicas each hold what the baseline holds.
    "gradient_accumulation": Support(compiles=True, accumulates=True, instead=_SHARDED, plans_as="baseline",
                                     diff_budget=50, reshards=True),
    "activation_checkpointing": Support(compiles=True, instead="recipes/combined.py --gradient_checkpointing",
                                        diff_budget=118),  # 107 with --checkpoint_every and the selective policy
    # 112: 106 measured with --comm_hook / --local_sgd_steps (2026-12-02), 34 the loop re-indented under LocalSGD
    "data_parallel": Support(compiles=True, instead=_SHARDED, plans_as="baseline", diff_budget=112, reshards=True),
    "optim_8bit": Support(instead="recipes/combined.py --optim adamw_bnb_8bit (ZeRO-1/2 without offload)",
                          diff_budget=55),
    # torchao's optimizers train under DDP and FSDP2 (benchmarks/compat_sweep.py); ZeRO: see the rule below.
    "optim_low_bit": Support(shardings=(*_CLASSIC, "fsdp"), instead="accelerate_configs/multi_cpu.yaml (DDP), "
                             "fsdp.yaml or fsdp_offload.yaml (FSDP2)", diff_budget=54),
    "pruning": Support(instead=_ONE_OR_DDP, not_planned=_NOT_PLANNED["pruning"], diff_budget=148),
    "qat": Support(instead=_ONE_OR_DDP, not_planned=_NOT_PLANNED["qat"], diff_budget=90),
    "ptq": Support(shardings=("none",), max_processes=1, instead="`python recipes/ptq.py` (one process)",
                   needs_trained_model=True, not_planned=_NOT_PLANNED["ptq"],
                   diff_budget=109),  # its Accelerator() passes none of the loop's arguments: it has no loop
    "model_parallel": Support(no_compile=_NO["model_parallel"], shardings=("none",), max_processes=1,
                              instead="recipes/data_model_parallel.py for stages with data-parallel replicas",
                              not_planned=_NOT_PLANNED["model_parallel"], diff_budget=95),
    "pipeline_parallel": Support(shardings=("ddp",), min_processes=2, instead="accelerate_configs/pipeline.yaml",
                                 own_attention_mask=True, no_compile=_NO["pipeline_parallel"],
                                 not_planned=_NOT_PLANNED["pipeline_parallel"], diff_budget=152),  # 145 measured
    "data_model_parallel": Support(no_compile=_NO["data_model_parallel"], shardings=("ddp",), min_processes=4,
                                   instead="accelerate_configs/data_model_parallel.yaml", own_attention_mask=True,
                                   not_planned=_NOT_PLANNED["pipeline_parallel"], diff_budget=160),
    # Tensor parallel (recipes/tensor_parallel.py): one TP group of all processes, or --tp_size N groups with FSDP2
    # across them on a (dp, tp) mesh it builds itself; the launch is a plain multi-process one.
    "tensor_parallel": Support(no_compile=_NO["tensor_parallel"], shardings=("ddp",), min_processes=2,
                               no_fp16="its loss scaler is not wired to the sharded gradients",
                               instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: "
                                       "the tensor-parallel degree), or tp2_dp2.yaml with --tp_size 2 (TP x FSDP2)",
                               async_checkpoint=True, diff_budget=146, reshards=True),  # +3: --async_checkpoint
    # Ulysses sequence parallel over all processes (recipes/sequence_parallel.py): each holds a chunk of every sequence.
    "sequence_parallel": Support(shardings=("ddp",), min_processes=2, splits_sequence=True,
                                 instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: "
                                         "the sequence-parallel degree)", diff_budget=62),  # 56 measured
    # Expert parallel (recipes/expert_parallel.py): the experts split over all processes, tokens sent to them by
    # all-to-all, the dense weights FSDP2-sharded over the same processes, each reading its own batches.
    "expert_parallel": Support(no_compile=_NO["expert_parallel"], shardings=("ddp",), min_processes=2,
                               no_fp16="its loss scaler is not wired to the sharded gradients",
                               instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: "
                                       "the expert-parallel degree, a divisor of the experts per layer)",
                               not_planned=_NOT_PLANNED["expert_parallel"], async_checkpoint=True,
                               diff_budget=103),  # 92 measured; +3: --async_checkpoint
    "zero": Support(shardings=_ZERO, accumulates=True, instead="accelerate_configs/zero1.yaml, zero2.yaml, zero3.yaml",
                    no_compile=_NO["zero"], diff_budget=84, reshards=True),  # +2: universal checkpoints (reshard.py)
    "zero3_offload": Support(no_compile=_NO["zero3_offload"], shardings=_ZERO, accumulates=True, needs_offload=True,
                             instead="accelerate_configs/zero3_offload.yaml, zero2_offload.yaml or zero3_nvme.yaml",
                             diff_budget=92),
    "fsdp": Support(shardings=("fsdp",), min_processes=2, instead="accelerate_configs/fsdp.yaml or fsdp_offload.yaml "
                    "(hsdp.yaml: HSDP)", async_checkpoint=True, reshards=True,  # SHARDED_STATE_DICT: DCP reshards
                    diff_budget=73),  # +15: --dp_replicate_size / --dp_shard_size (HSDP); +3: --async_checkpoint
    "qlora": Support(shardings=SHARDINGS, diff_budget=168),  # +4: its checkpoints keep the adapters (2026-12-01)
    # Saved-tensor hooks around forward: one process, DDP and FSDP2 run (tests/test_activation_offloading.py).
    "activation_offloading": Support(shardings=(*_CLASSIC, "fsdp"), diff_budget=54,
                                     instead="one process, accelerate_configs/multi_cpu.yaml (DDP) or fsdp.yaml",
                                     why_not="its saved-tensor hooks have not been run with DeepSpeed's engine here"),
    # planned: shared/tools/plan.py COMBINED; +12 lines for --activation_offloading, +44 for the ladder's flags
    # (2026-12-02)
    "combined": Support(shardings=SHARDINGS, diff_budget=209),
    # The head module's own hooks gather it (tests/test_chunked_loss.py).
    "chunked_loss": Support(shardings=SHARDINGS, diff_budget=63),
    # One process only (sharding "none" is never launched with more), found by running DDP over gloo with the hooks:
    # tests/test_optimizer_in_backward.py.
    "optimizer_in_backward": Support(
        shardings=("none",),
        instead="one process (`accelerate launch recipes/optimizer_in_backward.py`, accelerate_configs/"
                "single_process.yaml or bf16.yaml); over several processes, recipes/zero.py (ZeRO-2) or "
                "recipes/fsdp.py shard the gradients instead",
        why_not="its hooks step each parameter on this process's own gradient, before DDP's all-reduce has averaged "
                "it (measured on gloo: the replicas differ after one step, and DDP's buckets still hold the whole "
                "model's gradients, so nothing is saved); ZeRO and FSDP reduce gradients their own way, and the hooks "
                "are not wired to them here",
        diff_budget=49),
    # Accelerate's fp8 with torchao: one process and DDP over gloo measured (tests/test_fp8.py). FSDP2 (float8
    # all-gather of DTensor shards) and DeepSpeed were not run on this stack: refused rather than assumed.
    "fp8": Support(precision="fp8", instead="one process or DDP (accelerate_configs/single_process.yaml, "
                   "multi_cpu.yaml, multi_gpu.yaml)",
                   why_not="FP8 under FSDP2 or DeepSpeed has not been run here (torchao's float8 all-gather of "
                           "FSDP2 shards is the route to try on a GPU)",
                   not_planned=_NOT_PLANNED["fp8"], diff_budget=40),
}


@dataclass(frozen=True)
class Run:
    """What one run asks for, in the table's words. `flags` says how this recipe spells each field, for messages."""

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
    load_in: str = "full"  # full | 8bit | 4bit: base weights, quantized by bitsandbytes unless full (LOAD_IN)
    quant_storage: str = "uint8"
    lora: bool = False
    dora: bool = False  # the LoRA adapters as DoRA (PEFT use_dora)
    # an --optim name (shared/core/args.py OPTIMIZERS: adamw, adamw_bnb_8bit, adamw_torchao_8bit / 4bit / fp8), or
    # adamw_in_backward (torch AdamW, each parameter stepped in its gradient hook)
    optimizer: str = "adamw"
    in_backward: bool = False  # recipes/combined.py --optimizer_in_backward: the --optim stepped in gradient hooks
    max_grad_norm: float = 0.0  # global-norm clipping (0: none)
    spread_devices: bool = False  # one model over several devices (device_map="auto")
    merge_unsaved: bool = False  # merge an adapter that is not saved
    stages_per_replica: int = 0  # pipeline stages inside each data-parallel replica (0: no such mesh)
    tensor_parallel_size: int = 0  # processes per tensor-parallel group, data parallel across them (0: all of them)
    dp_replicate_size: int = 0  # HSDP (recipes/fsdp.py): replicas, each sharded over dp_shard_size processes (0: unset)
    dp_shard_size: int = 0  # HSDP: processes one replica is sharded over (0: unset)
    parallelism_config: str = ""  # Accelerate's ParallelismConfig from the launch config, e.g. "tp=2 cp=2" ("": none)
    packing: str = "none"  # causal LM: concat | per_document | none (shared/core/packing.py)
    compile: str = "none"  # torch.compile through Accelerate's TorchDynamoPlugin: none | regional | full
    task: str = ""  # text-classification | causal-lm | image-classification ("": not checked)
    seq_len: int = 0  # --max_seq_length (0: not checked)
    microbatches: int = 0  # pipeline micro-batches per batch, --n_microbatches (0: not pipelined)
    schedule_refuses: str = ""  # why the pipeline schedule cannot run that many (torch's words; "": it runs them)
    schedule_takes: tuple[int, ...] = ()  # the nearest micro-batch counts it runs
    batch_size: int = 0  # --per_device_train_batch_size (0: not checked)
    checkpoint_impl: str = ""  # --checkpointing_impl as asked: hf | torch ("": unset, the recipe picks)
    checkpoint_every: int = 0  # checkpoint every k-th block (0: not checked)
    checkpoint_policy: str = ""  # full | selective ("": not checked)
    checkpointing: bool | None = None  # a flag turns activation checkpointing on (None: the recipe always does)
    shard_vocab: bool = False  # tensor parallel: the embedding and head split over the vocabulary too
    chunked_loss: bool = False  # the head's matmul and loss a chunk of tokens at a time
    async_checkpoint: bool = False  # --async_checkpoint: checkpoints written in the background
    comm_hook: str = "no"  # data_parallel.py's DDP comm hook: no | fp16 | bf16 | power_sgd | batched_power_sgd
    local_sgd_steps: int = 0  # LocalSGD: the parameters averaged every K steps (0: off)
    powersgd_start: int = 0  # PowerSGD's first compressed step
    powersgd_typed: str = ""  # the PowerSGD flags given
    train_steps: int = 0  # --max_train_steps (0: not given)
    checkpoints: bool = False  # --checkpointing_steps or --resume_from_checkpoint given
    activation_offload: str = ""  # all | checkpointed: saved tensors moved off the device ("": none)
    activation_offload_to: str = "cpu"  # cpu | disk
    activation_offload_dir: bool = False  # a directory for the disk was given
    model_given: bool = True  # --model_name_or_path was passed (False: the recipe's own fresh preset)
    preset: str = ""  # --model_preset when no --model_name_or_path is given ("": a given model)
    # Facts known only once the model or the Accelerator is built: check_built(...) weighs them against the same
    # table (the defaults mean "not known", and no rule reads them then).
    model_type: str = ""  # config.model_type
    tp_plans: tuple[str, ...] = ()  # model types shared/techniques/tensor_parallel.py has a plan for
    stage_families: tuple[str, ...] = ()  # model types shared/techniques/pipeline_stages.py can split into stages
    heads: int = 0  # attention heads
    kv_heads: int = 0  # key/value heads
    mlp_width: int = 0  # the MLP's hidden units
    tp_degree: int = 0  # processes the blocks split over (tensor parallel)
    tp_plan_source: str = ""  # own (the config's base_model_tp_plan) | ours (tensor_parallel.py PLANS)
    sp_degree: int = 0  # processes each sequence splits over (Ulysses)
    experts: int = 0  # experts per MoE layer
    ep_dispatch: bool | None = None  # the config's base_model_ep_plan dispatches tokens to the experts (None: unknown)
    ep_degree: int = 0  # processes the experts split over (expert parallel)
    layers: int = 0  # transformer blocks
    stages: int = 0  # pipeline stages
    devices: int = 0  # accelerator devices visible to the one process that drives them all
    device_kind: str = ""  # their type (cuda, xpu, ...)
    device: str = ""  # the Accelerator's device type
    paged: bool = False  # bitsandbytes' paged optimizer (CUDA unified memory)
    group_size: int = 0  # quantization group size
    in_features: tuple[int, ...] = ()  # in_features of the Linear layers in the blocks
    head_kind: str = ""  # class of the model's output head ("None": get_output_embeddings() gave none)
    logit_transform: str = ""  # a config entry that changes the logits after the head ("final_logit_softcapping=30")
    head_calls: int = 1  # head calls in one forward (the chunked loss hooks the one that makes the logits)
    head_reshaped: bool = False  # the forward changed the head's output shape
    linear_head_needed: bool = False  # a whole nn.Linear copy of the head is built (the chunked loss's measure)
    resolved_precision: str = ""  # Accelerator.mixed_precision
    fp8_backend: str = ""  # Accelerator.fp8_backend's name
    fp8_converted: int = -1  # Linears converted to Float8Linear (-1: not known)
    fp8_kept: str = ""  # the Linears kept in high precision
    linear_only: str = ""  # what the technique does to the blocks' nn.Linear layers, and to nothing else ("prunes")
    outside_linear: str = ""  # the blocks' weights no nn.Linear holds (a mixture of experts' experts), in words
    flags: Mapping[str, str] = field(default_factory=dict)

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


def _launch_words(run: Run) -> str:
    return {"none": "one process", "ddp": f"{run.num_processes} processes of plain data parallel",
            "fsdp": "FSDP"}.get(run.launched, f"DeepSpeed ZeRO-{run.launched[-1]}")


def _kind(sharding: str) -> str:
    return "zero" if sharding.startswith("zero") else sharding


def _in_backward(run: Run) -> bool:
    return run.optimizer == "adamw_in_backward" or run.in_backward


def _processes(n: int) -> str:
    return "1 was" if n == 1 else f"{n} were"


RULES: tuple[Rule, ...] = (
    # First: the specific reason reads before the generic 'does not implement' one.
    Rule(lambda r: r.optimizer in TORCHAO_OPTIMIZERS and r.sharding.startswith("zero"),
         # Measured 2026-12-01, 2 processes: tiny GPT-2 kept all state in 32 bits under ZeRO-1/2/3 (loss identical
         # to torch AdamW's); at width 256 one of ZeRO-2's two partitions was quantized.
         lambda r: f"{r.flag('optimizer')} under DeepSpeed ZeRO-{r.sharding[-1]}: torchao's optimizer would step "
                   "DeepSpeed's flat fp32 partitions (one per parameter group and process), quantized only when a "
                   "partition's size is a multiple of its block size and otherwise silently kept in 32 bits, beside "
                   "DeepSpeed's own fp32 master copy",
         lambda r: "use DDP or FSDP2 with torchao's optimizers (accelerate_configs/multi_cpu.yaml, fsdp.yaml, "
                   "fsdp_offload.yaml), or bitsandbytes' 8-bit under ZeRO-1/2: recipes/combined.py --optim "
                   "adamw_bnb_8bit"),
    Rule(lambda r: _kind(r.launched) in ("zero", "fsdp") and _kind(r.sharding) != _kind(r.launched),
         lambda r: f"the launch config asks for {_launch_words(r)}, and recipes/{r.recipe}.py runs "
                   f"{'DeepSpeed' if _kind(r.sharding) == 'zero' else 'FSDP'} itself",
         lambda r: "launch it with a plain config (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml) or one of "
                   f"its own kind ({RECIPES[r.recipe].instead})"),
    Rule(lambda r: r.sharding not in RECIPES[r.recipe].shardings,
         lambda r: f"recipes/{r.recipe}.py does not implement {_launch_words(r)}, which the launch config asks for; "
                   f"{RECIPES[r.recipe].why_not or 'it would crash or train something else'}",
         lambda r: f"use {RECIPES[r.recipe].instead}"),
    Rule(lambda r: r.num_processes < RECIPES[r.recipe].min_processes,
         lambda r: f"recipes/{r.recipe}.py needs at least {RECIPES[r.recipe].min_processes} processes, and "
                   f"{_processes(r.num_processes)} launched",
         lambda r: f"launch it with {RECIPES[r.recipe].instead}"),
    Rule(lambda r: (RECIPES[r.recipe].max_processes or r.num_processes) < r.num_processes,
         lambda r: f"recipes/{r.recipe}.py runs in one process that drives all its devices, and "
                   f"{_processes(r.num_processes)} launched",
         lambda r: f"use {RECIPES[r.recipe].instead}"),
    Rule(lambda r: RECIPES[r.recipe].needs_offload and r.offload == "none",
         lambda r: f"recipes/{r.recipe}.py shows offload, and the launch config offloads nothing",
         lambda r: f"use {RECIPES[r.recipe].instead}, or recipes/zero.py for ZeRO without offload"),
    Rule(lambda r: RECIPES[r.recipe].precision not in ("", r.precision),
         lambda r: f"mixed precision {r.precision!r} (from --mixed_precision or the launch config): "
                   f"recipes/{r.recipe}.py trains in {RECIPES[r.recipe].precision} only",
         lambda r: "drop --mixed_precision and use a launch config with mixed_precision 'no' (accelerate_configs/"
                   "single_process.yaml, multi_cpu.yaml), or recipes/mixed_precision.py for fp16 / bf16"),
    Rule(lambda r: r.compile != "none" and not RECIPES[r.recipe].compiles,
         lambda r: f"--torch_compile {r.compile} (the flag or the launch config's dynamo_config): "
                   f"recipes/{r.recipe}.py does not compile its model: "
                   f"{RECIPES[r.recipe].no_compile or 'it has not been run compiled here'}",
         lambda r: "drop --torch_compile (and set dynamo_backend: NO in the launch config), or use a recipe that "
                   "compiles: " + ", ".join(f"recipes/{n}.py" for n, s in RECIPES.items() if s.compiles)),
    Rule(lambda r: r.async_checkpoint and not RECIPES[r.recipe].async_checkpoint,
         lambda r: f"--async_checkpoint: recipes/{r.recipe}.py writes its checkpoints with torch.save / safetensors "
                   "(or DeepSpeed's own writer), not torch.distributed.checkpoint, whose async_save is what writes "
                   "one in the background",
         lambda r: "drop --async_checkpoint, or use a recipe whose checkpoints are DCP shards: " + ", ".join(
             f"recipes/{n}.py" for n, s in RECIPES.items() if s.async_checkpoint)),
    # Pipeline schedules (recipes/pipeline_parallel.py, data_model_parallel.py) split each batch into micro-batches.
    # A count the schedule itself cannot run (torch's schedule classes say which: recipes/pipeline_parallel.py asks).
    Rule(lambda r: r.microbatches > 0 and bool(r.batch_size % r.microbatches or r.schedule_refuses),
         lambda r: (f"--per_device_train_batch_size {r.batch_size} is not divisible by --n_microbatches "
                    f"{r.microbatches}: the schedule splits each batch into that many equal micro-batches")
         if r.batch_size % r.microbatches else (f"{r.flag('schedule')} cannot run --n_microbatches {r.microbatches} "
                                                f"on {r.num_processes} processes (torch: {r.schedule_refuses})"),
         lambda r: ("pick a batch size that is a multiple of it (e.g. --per_device_train_batch_size "
                    f"{r.microbatches * max(1, r.batch_size // r.microbatches)}), or fewer --n_microbatches")
         if r.batch_size % r.microbatches else (f"pass --n_microbatches {' or '.join(map(str, r.schedule_takes))} "
                                                "(and a --per_device_train_batch_size it divides)")),
    Rule(lambda r: r.microbatches > 0 and r.accumulation > 1,
         lambda r: f"--gradient_accumulation_steps {r.accumulation}: recipes/{r.recipe}.py's micro-batches already "
                   "accumulate (the schedule sums their gradients before each step)",
         lambda r: "drop the flag, and raise --n_microbatches and the batch size instead"),
    Rule(lambda r: r.accumulation > 1 and not RECIPES[r.recipe].accumulates and not _in_backward(r)
         and not r.microbatches,
         lambda r: f"--gradient_accumulation_steps {r.accumulation}: recipes/{r.recipe}.py does not accumulate "
                   "gradients (Accelerate would still divide every loss by it)",
         lambda r: "use recipes/gradient_accumulation.py or recipes/zero.py, or drop the flag"),
    # The optimizer step in backward (recipes/optimizer_in_backward.py): a parameter steps, and its gradient is freed,
    # the moment that gradient is complete, so nothing can look at all the gradients first, or add to them later.
    Rule(lambda r: _in_backward(r) and r.accumulation > 1,
         lambda r: f"--gradient_accumulation_steps {r.accumulation} with the optimizer step in backward: each "
                   "parameter steps, and its gradient is freed, as soon as that gradient is computed, so there is no "
                   "gradient left to accumulate the next micro-batch into",
         lambda r: "drop the flag and raise --per_device_train_batch_size for a larger batch, or use "
                   "recipes/gradient_accumulation.py"),
    Rule(lambda r: _in_backward(r) and r.max_grad_norm > 0,
         lambda r: f"--max_grad_norm {r.max_grad_norm:g} with the optimizer step in backward: clipping by the global "
                   "norm needs every gradient before any parameter steps, and here each parameter steps (and frees "
                   "its gradient) as soon as its own gradient exists",
         lambda r: "pass --max_grad_norm 0 (this recipe's default), or use recipes/baseline.py to clip"),
    Rule(lambda r: _in_backward(r) and r.precision == "fp16",
         lambda r: "fp16 with the optimizer step in backward: the loss scaler must unscale every gradient and check "
                   "them all for inf/NaN before any parameter steps, and here each parameter steps inside backward "
                   "with its still-scaled gradient",
         lambda r: "use --mixed_precision bf16 (no loss scaling) or no"),
    Rule(lambda r: r.in_backward and r.sharding != "none",
         lambda r: f"{r.flag('in_backward')} under {_launch_words(r)}: each parameter would step in its gradient hook "
                   "before the processes' gradients are averaged (DDP) or partitioned (ZeRO, FSDP)",
         lambda r: f"launch one process, or drop {r.flag('in_backward')} (ZeRO-2 shards the gradients instead)"),
    Rule(lambda r: r.checkpoint_policy == "selective" and r.checkpointing is False,
         lambda r: "--checkpointing_policy selective chooses what checkpointing keeps, and --gradient_checkpointing "
                   "is off",
         lambda r: "add --gradient_checkpointing, or drop --checkpointing_policy"),
    Rule(lambda r: r.load_in != "full" and not r.lora,
         lambda r: f"{r.flag('load_in')}: quantized base weights are frozen and cannot train",
         lambda r: f"add {r.flag('lora')} (adapters train on top of them), or load full weights"),
    Rule(lambda r: r.dora and not r.lora,
         lambda r: f"{r.flag('dora')} makes the LoRA adapters DoRA adapters, and {r.flag('lora')} trains none",
         lambda r: f"add {r.flag('lora')}, or drop {r.flag('dora')}"),
    # Tried (benchmarks/compat_sweep.py, 2026-12-01): every ZeRO-3 cell of DoRA on a 4-bit base crashed in the first
    # backward, with or without checkpointing and offload; LoRA on the same base trains there.
    Rule(lambda r: r.dora and r.load_in != "full" and r.sharding == "zero3",
         lambda r: f"{r.flag('dora')} on a {r.load_in.replace('bit', '-bit')} base under zero3: DeepSpeed's backward "
                   "hooks meet a bitsandbytes weight they never partitioned (AttributeError: 'Params4bit' object has "
                   "no attribute 'ds_status')",
         lambda r: f"use FSDP (accelerate_configs/fsdp.yaml) or ZeRO-1/2 for DoRA, or drop {r.flag('dora')} "
                   "(LoRA on this base trains under ZeRO-3)"),
    Rule(lambda r: r.load_in == "8bit" and r.sharded_params,
         lambda r: f"{r.flag('load_in')} under {r.sharding}: int8 bitsandbytes weights cannot be sharded",
         lambda r: f"use 4-bit weights with {r.flag('quant_storage')} bfloat16, or ZeRO-1/2 / DDP"),
    Rule(lambda r: r.load_in == "4bit" and r.sharded_params and r.quant_storage == "uint8",
         lambda r: f"{r.flag('load_in')} under {r.sharding}: parameters are sharded per floating dtype, and "
                   "4-bit weights are packed in uint8 by default",
         lambda r: f"pass {r.flag('quant_storage')} bfloat16 (the model's dtype), or use ZeRO-1/2 / DDP"),
    Rule(lambda r: r.spread_devices and r.num_processes > 1,
         lambda r: f"{r.flag('spread_devices')} spreads one model over several devices, which cannot train "
                   f"data-parallel in {r.num_processes} processes (each needs its whole copy)",
         lambda r: "drop the flag (one copy per process), or launch a single process"),
    Rule(lambda r: r.spread_devices and r.sharded_params,
         lambda r: f"{r.flag('spread_devices')} under {r.sharding}, which places the shards itself",
         lambda r: "drop the flag"),
    Rule(lambda r: r.stages_per_replica > 0 and (r.stages_per_replica < 2 or r.num_processes % r.stages_per_replica
                                                  or r.num_processes == r.stages_per_replica),
         lambda r: f"{r.num_processes} processes cannot form 2 or more replicas of "
                   f"{r.stages_per_replica} stages ({r.flag('stages_per_replica')} must be at least 2)",
         lambda r: f"launch a multiple of {r.stages_per_replica} processes (e.g. --num_processes "
                   f"{2 * max(r.stages_per_replica, 2)}), or use recipes/pipeline_parallel.py for one replica"),
    Rule(lambda r: r.tensor_parallel_size > 0 and (r.tensor_parallel_size < 2
                                                    or r.num_processes % r.tensor_parallel_size),
         lambda r: f"{r.flag('tensor_parallel_size')} {r.tensor_parallel_size} with {r.num_processes} processes: a "
                   "tensor-parallel group needs 2 or more processes, and the groups must divide the processes",
         lambda r: f"pass a divisor of {r.num_processes} that is at least 2 (e.g. {r.flag('tensor_parallel_size')} "
                   "2 with accelerate_configs/tp2_dp2.yaml), leave it unset for one group of all processes, or use "
                   "recipes/fsdp.py for data parallel alone"),
    # HSDP (recipes/fsdp.py --dp_replicate_size / --dp_shard_size; under ZeRO: the rule on launches above).
    Rule(lambda r: bool(_hsdp(r)) and not _hsdp_fills(r),
         lambda r: f"{_hsdp(r)} with {'one process' if r.num_processes == 1 else f'{r.num_processes} processes'}: "
                   "the dp_replicate x dp_shard mesh must hold every process once",
         lambda r: "launch R x S processes: accelerate_configs/hsdp.yaml (4, --dp_replicate_size 2)"
         if r.num_processes == 1 else f"pass sizes whose product is {r.num_processes}, or one, a divisor of it "
                                      "(e.g. --dp_replicate_size 2 on 4; nodes: --dp_shard_size = GPUs per node)"),
    Rule(lambda r: bool(_hsdp(r)) and r.num_processes > 1 and _hsdp_fills(r) and _hsdp_sizes(r)[1] == 1,
         lambda r: f"{_hsdp(r)} with {r.num_processes} processes makes each replica one process: plain data "
                   "parallel, nothing for FSDP2 to shard (Accelerate refuses dp_shard_size 1 under FSDP)",
         lambda r: "use fewer replicas (--dp_shard_size 2 or more), or recipes/data_parallel.py for DDP"),
    Rule(lambda r: "tp=" in r.parallelism_config and r.launched == "fsdp",
         lambda r: f"the launch config's ParallelismConfig ({r.parallelism_config}) under FSDP: Accelerate 1.15 "
                   "imports transformers' ReplicateParallel for TP x FSDP2, which transformers 5.24 lacks",
         lambda r: "drop parallelism_config from the launch config and use recipes/tensor_parallel.py --tp_size N "
                   "with accelerate_configs/tp2_dp2.yaml"),
    # Measured 2026-12-01 (docs/tensor_parallel.md): Accelerate 1.15 refuses CPU distributed types when it validates
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
    # Communication reduction (shared/techniques/comm_reduction.py): each would otherwise do nothing, silently.
    Rule(lambda r: (r.comm_hook != "no" or r.local_sgd_steps > 0) and r.num_processes < 2,
         lambda r: ("--local_sgd_steps" if r.local_sgd_steps else f"--comm_hook {r.comm_hook}") + " with one process: "
                   "nothing is all-reduced (Accelerate wraps no DDP model, and LocalSGD turns itself off)",
         lambda r: "launch 2 or more processes (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml), or drop the flag"),
    Rule(lambda r: r.comm_hook != "no" and r.local_sgd_steps > 0,
         lambda r: f"--comm_hook {r.comm_hook} with --local_sgd_steps: LocalSGD runs DDP under no_sync, so no "
                   "gradient is all-reduced and the hook never runs",
         lambda r: "pick one: --comm_hook to send every step's gradients compressed, or --local_sgd_steps"),
    Rule(lambda r: bool(r.powersgd_typed) and "power_sgd" not in r.comm_hook,
         lambda r: f"{r.powersgd_typed} tune PowerSGD, and --comm_hook {r.comm_hook} does not run it",
         lambda r: "add --comm_hook power_sgd (or batched_power_sgd), or drop them"),
    Rule(lambda r: r.comm_hook == "bf16" and not r.on_accelerator,  # though gloo all-reduces bf16 (tried here)
         lambda r: "--comm_hook bf16 on a CPU-only machine: torch's DDP refuses bf16_compress_hook without CUDA "
                   "and NCCL 2.10+ (or XPU and XCCL)",
         lambda r: "use --comm_hook fp16 (the same 2 bytes a value) on CPU, bf16 on GPUs"),
    Rule(lambda r: "power_sgd" in r.comm_hook and 0 < r.train_steps <= r.powersgd_start,
         lambda r: f"--max_train_steps {r.train_steps} with --powersgd_start_iter {r.powersgd_start}: PowerSGD sends "
                   "plain fp32 gradients before that step, so this run would never compress",
         lambda r: f"pass --powersgd_start_iter below {r.train_steps} (at least 2; torch suggests 10% of the steps)"),
    Rule(lambda r: r.local_sgd_steps > 0 and r.checkpoints,
         lambda r: "--local_sgd_steps with checkpoints: each process steps its own AdamW moments between averages, "
                   "and a checkpoint keeps process 0's, so a resumed run would not continue the saved one",
         lambda r: "drop --checkpointing_steps / --resume_from_checkpoint, or use --comm_hook (replicas always equal)"),
    Rule(lambda r: r.attention.startswith("flash_attention") and not r.on_accelerator,
         lambda r: f"--attn_implementation {r.attention} runs on CUDA GPUs only, and this machine has none",
         lambda r: "pass --attn_implementation sdpa (or eager), or leave it unset"),
    Rule(lambda r: r.packing == "per_document" and RECIPES[r.recipe].own_attention_mask,
         lambda r: f"--packing per_document: recipes/{r.recipe}.py runs the model through its own pipeline stages, "
                   "whose plain causal mask would let packed documents attend to each other",
         lambda r: "use --packing concat or --packing none with it"),
    Rule(lambda r: r.task not in ("", "causal-lm") and r.packing != "none",
         lambda r: f"--packing {r.packing} with --task {r.task}: it packs causal-LM documents, so it would do nothing",
         lambda r: "drop --packing, or pass --task causal-lm"),
    # Sequence parallel (recipes/sequence_parallel.py): each process runs its chunk of every causal-LM sequence.
    Rule(lambda r: RECIPES[r.recipe].splits_sequence and r.task not in ("", "causal-lm"),
         lambda r: f"--task {r.task}: recipes/{r.recipe}.py splits causal-LM sequences (its attention is causal "
                   "over the gathered sequence, its loss next-token)",
         lambda r: "pass --task causal-lm, or use recipes/data_parallel.py for this task"),
    Rule(lambda r: RECIPES[r.recipe].splits_sequence and r.seq_len and r.seq_len % r.num_processes,
         lambda r: f"--max_seq_length {r.seq_len} does not split into {r.num_processes} equal chunks (one per "
                   "process)",
         lambda r: f"pass a multiple of {r.num_processes}, e.g. --max_seq_length "
                   f"{max(r.num_processes, r.seq_len - r.seq_len % r.num_processes)}"),
    Rule(lambda r: RECIPES[r.recipe].splits_sequence and r.task == "causal-lm" and r.packing != "concat",
         lambda r: f"--packing {r.packing}: recipes/{r.recipe}.py attends causally over whole packed blocks, and "
                   + ("per-document masks are not exchanged between the chunks" if r.packing == "per_document" else
                      "padded samples of varying length do not split into equal chunks"),
         lambda r: "use --packing concat (the default)"),
    Rule(lambda r: r.merge_unsaved,
         lambda r: f"{r.flag('merge_unsaved')} merges the saved adapter, and --no_save_model skips saving it",
         lambda r: "drop one of them"),
    Rule(lambda r: r.optimizer == "adamw_bnb_8bit" and r.sharding.startswith("zero") and r.offload != "none",
         # Accelerate swaps any optimizer for DeepSpeedCPUAdam under ZeRO offload: 32-bit state, not the 8-bit asked.
         lambda r: f"{r.flag('optimizer')} with ZeRO {r.offload} offload: the offloaded step runs DeepSpeedCPUAdam "
                   "(32-bit state in host memory), so the 8-bit optimizer would silently not be used",
         lambda r: f"drop {r.flag('optimizer')} (offload already moves the state off the device), or drop the "
                   "offload"),
    Rule(lambda r: r.optimizer == "adamw_bnb_8bit" and r.sharding == "fsdp",
         lambda r: f"{r.flag('optimizer')} under FSDP: bitsandbytes' optimizer kernels do not take FSDP2's sharded "
                   "DTensor parameters (NotImplementedError in optimizer_update)",
         lambda r: "use ZeRO-1/2 or DDP with the 8-bit optimizer, or torch AdamW under FSDP"),
    Rule(lambda r: r.sharding in ("zero1", "zero2") and r.offload == "nvme",
         # DeepSpeed 0.19's stage 1/2 optimizer treats any offload device as CPU memory: nothing would reach NVMe.
         lambda r: f"optimizer offload to nvme under ZeRO stage {r.sharding[-1]}: stages 1 and 2 keep offloaded "
                   "optimizer state in CPU memory whatever the device says",
         lambda r: "use ZeRO-3 for NVMe offload (accelerate_configs/zero3_nvme.yaml), or offload to cpu"),
    Rule(lambda r: r.sharding.startswith("zero") and r.precision == "fp16" and not r.on_accelerator,
         lambda r: "fp16 under DeepSpeed needs a GPU: on CPU DeepSpeed refuses it ('Type fp16 is not supported on "
                   "your device')",
         lambda r: "use --mixed_precision bf16 (or no)"),
    Rule(lambda r: bool(RECIPES[r.recipe].no_fp16) and r.precision == "fp16",
         lambda r: f"fp16 with recipes/{r.recipe}.py: {RECIPES[r.recipe].no_fp16}",
         lambda r: "use --mixed_precision bf16 or no"),
    Rule(lambda r: RECIPES[r.recipe].needs_trained_model and not r.model_given,
         lambda r: f"recipes/{r.recipe}.py quantizes a trained model, and no --model_name_or_path was passed (a "
                   "fresh preset has learned nothing to keep)",
         lambda r: "pass --model_name_or_path (e.g. the output_dir of recipes/baseline.py)"),
    # Activation checkpointing (recipes/activation_checkpointing.py): HF's switch wraps every block whole.
    Rule(lambda r: r.checkpoint_impl == "hf" and (r.checkpoint_every > 1 or r.checkpoint_policy == "selective"),
         lambda r: "--checkpointing_impl hf checkpoints every block whole: --checkpoint_every > 1 and "
                   "--checkpointing_policy selective need --checkpointing_impl torch",
         lambda r: "pass --checkpointing_impl torch (or leave it unset)"),
    Rule(lambda r: r.preset in ("tiny-llama", "tiny-moe") and r.task == "image-classification",
         lambda r: f"--model_preset {r.preset} is a decoder for text (Llama / Mixtral style), and --task "
                   "image-classification needs an image model",
         lambda r: "pass --task causal-lm or text-classification, or --model_preset tiny (ViT) for images"),
    Rule(lambda r: r.preset == "tiny-moe" and r.task == "text-classification",
         lambda r: "--model_preset tiny-moe with --task text-classification: Transformers' "
                   "MixtralForSequenceClassification returns no router aux_loss, so the router's load-balancing loss "
                   "would silently not train",
         lambda r: "use --task causal-lm for the mixture of experts, or --model_preset tiny-llama to classify text"),
    Rule(lambda r: r.shard_vocab and r.task not in ("", "causal-lm"),
         lambda r: f"{r.flag('shard_vocab')} with --task {r.task}: only the causal LM has a vocabulary-sized head; "
                   "BERT's and ViT's heads are classifiers of num_labels outputs, too small to split",
         lambda r: f"drop {r.flag('shard_vocab')}, or use --task causal-lm"),
    # Activation offloading (techniques/activation_offload.py): DeepSpeed's engine was not run with the hooks here.
    Rule(lambda r: bool(r.activation_offload) and r.sharding.startswith("zero"),
         lambda r: f"{r.flag('activation_offload')} under DeepSpeed ZeRO-{r.sharding[-1]}: the saved-tensor hooks have "
                   "not been run with DeepSpeed's engine (its ZeRO-3 parameter hooks) here",
         lambda r: "use one process, DDP or FSDP2 (accelerate_configs/multi_cpu.yaml, fsdp.yaml)"),
    Rule(lambda r: r.activation_offload == "checkpointed" and r.checkpointing is False,
         lambda r: f"{r.flag('activation_offload')} moves the inputs of checkpointed blocks, and none is checkpointed",
         lambda r: f"add {r.flag('checkpointing')}, or pass {r.flag('activation_offload').split()[0]} all"),
    Rule(lambda r: r.activation_offload_to == "disk" and (not r.activation_offload_dir
                                                          or r.activation_offload != "checkpointed"),
         lambda r: "--offload_to disk writes one file per checkpointed block input: it needs --offload_dir and "
                   "--offload_mode checkpointed",
         lambda r: "pass --offload_dir DIR (a local disk with room for one step's block inputs) and --offload_mode "
                   "checkpointed, or --offload_to cpu"),
    Rule(lambda r: r.chunked_loss and r.task not in ("", "causal-lm"),
         lambda r: f"{r.flag('chunked_loss')} chunks a causal LM's vocabulary logits, and --task {r.task} has no "
                   "vocabulary head",
         lambda r: f"pass --task causal-lm, or use recipes/baseline.py for {r.task}"),
    # ---- Rules on what only shows once the model or the Accelerator is built: check_built(fact=...).
    Rule(lambda r: bool(r.model_type and r.tp_plans) and r.model_type not in r.tp_plans,
         lambda r: f"The {r.model_type!r} model has no tensor-parallel plan: its config ships no base_model_tp_plan "
                   f"(Llama, Qwen, Mistral and Mixtral do), and shared/techniques/tensor_parallel.py PLANS has one "
                   f"for {sorted(r.tp_plans)} only",
         lambda r: "add its block's column/row-wise modules to shared/techniques/tensor_parallel.py PLANS, or use "
                   "recipes/fsdp.py (it shards any model)", built=True),
    Rule(lambda r: r.shard_vocab and r.tp_plan_source == "own",
         lambda r: f"{r.flag('shard_vocab')} with the {r.model_type} model's own tensor-parallel plan: that plan "
                   "already splits the embedding and the head over the vocabulary, and gathers the logits for the loss",
         lambda r: f"drop {r.flag('shard_vocab')} (the vocabulary is split without it)", built=True),
    Rule(lambda r: r.tp_degree > 0 and bool(_unsplit(r, r.tp_degree, heads=r.heads, kv_heads=r.kv_heads,
                                                      mlp_width=r.mlp_width)),
         lambda r: f"The model's {_unsplit(r, r.tp_degree, heads=r.heads, kv_heads=r.kv_heads, mlp_width=r.mlp_width)}"
                   f" does not split over {r.tp_degree} processes (each takes an equal share of the heads, of the "
                   "key/value heads and of the MLP's units)",
         lambda r: "launch a divisor of it (--num_processes, or --tp_size), or pick a model whose heads and MLP width "
                   "it divides", built=True),
    Rule(lambda r: r.sp_degree > 0 and bool(_unsplit(r, r.sp_degree, heads=r.heads, kv_heads=r.kv_heads)),
         lambda r: f"The model's {r.heads} attention heads ({r.kv_heads} key/value heads) do not split over "
                   f"{r.sp_degree} processes: Ulysses gives each process heads/N of them",
         lambda r: "launch a divisor of the head count (--num_processes), or pick a model whose heads it divides",
         built=True),
    Rule(lambda r: r.ep_dispatch is False,
         lambda r: f"The {r.model_type or 'model'} config has no expert-parallel plan that dispatches tokens to "
                   "experts (config.base_model_ep_plan with an 'ep_dispatch_experts' rule): it is not a mixture of "
                   "experts that Transformers can split",
         lambda r: "use --model_preset tiny-moe or a mixture-of-experts model whose config has one (Mixtral, "
                   "Qwen-MoE, DeepSeek-V3, ...), or recipes/fsdp.py to shard a dense model", built=True),
    Rule(lambda r: r.ep_degree > 0 and bool(_unsplit(r, r.ep_degree, experts=r.experts)),
         lambda r: f"The model's {r.experts} experts per layer do not split over {r.ep_degree} processes (each "
                   "holds an equal share of them, whole)",
         lambda r: "launch a divisor of it (--num_processes), or pick a model whose expert count it divides",
         built=True),
    Rule(lambda r: bool(r.model_type and r.stage_families) and r.model_type not in r.stage_families,
         lambda r: f"Pipeline stages are written for {sorted(r.stage_families)} models; this one is "
                   f"{r.model_type!r}",
         lambda r: "add its embeddings and head to shared/techniques/pipeline_stages.py FAMILIES and Stage.forward",
         built=True),
    Rule(lambda r: r.stages > 0 and 0 < r.layers < r.stages,
         lambda r: f"The model has {r.layers} blocks, fewer than the {r.stages} stages"
                   + (f" ({r.flags['stages']})" if r.flags.get("stages") else ""),
         lambda r: "use fewer processes/devices or stages, or a deeper model (--model_preset base)", built=True),
    Rule(lambda r: r.devices >= 2 and r.stages > r.devices,
         lambda r: f"{r.flag('stages')} {r.stages} but only {r.devices} {r.device_kind} devices: each stage needs "
                   "its own",
         lambda r: f"pass {r.flag('stages')} {r.devices} or less", built=True),
    Rule(lambda r: r.layers > 0 and r.checkpoint_every > r.layers,
         lambda r: f"--checkpoint_every {r.checkpoint_every} checkpoints no block: the model has {r.layers}",
         lambda r: f"pass --checkpoint_every {r.layers} or less", built=True),
    Rule(lambda r: r.group_size > 0 and any(f % r.group_size for f in r.in_features),
         lambda r: f"--group_size {r.group_size} must divide the in_features of every Linear layer in the "
                   f"transformer blocks ({sorted(set(r.in_features))})",
         lambda r: "pass a divisor, e.g. 32", built=True),
    Rule(lambda r: r.paged and r.device not in ("", "cuda"),
         # bitsandbytes would warn and silently allocate ordinary memory: nothing would be paged.
         lambda r: f"--paged needs a CUDA device (unified memory); this run is on {r.device}",
         lambda r: "drop --paged (plain AdamW8bit saves the same state bytes) or run on a CUDA GPU", built=True),
    Rule(lambda r: r.head_kind == "None",
         lambda r: f"the {r.model_type} model has no output embeddings (get_output_embeddings() is None): "
                   "there are no vocabulary logits to chunk",
         lambda r: "use recipes/baseline.py", built=True),
    Rule(lambda r: bool(r.logit_transform),
         lambda r: f"the model transforms its logits after the head (config.{r.logit_transform}), which the chunked "
                   "loss would skip",
         lambda r: "use recipes/baseline.py for this model", built=True),
    Rule(lambda r: r.head_calls != 1 or r.head_reshaped,
         lambda r: f"the model calls its head {r.head_calls} times in a forward, or reshapes its output: the chunked "
                   "loss cannot tell which call makes the logits",
         lambda r: "use recipes/baseline.py", built=True),
    Rule(lambda r: r.linear_head_needed and r.head_kind != "Linear",
         lambda r: f"The model's head is a {r.head_kind}, not an nn.Linear",
         lambda r: "use recipes/baseline.py", built=True),
    # Accelerate turns fp8 into fp16 on a GPU older than Ada/Hopper with a warning, no error.
    Rule(lambda r: bool(r.resolved_precision) and RECIPES.get(r.recipe, Support()).precision == "fp8"
         and (r.resolved_precision != "fp8" or r.fp8_backend != "AO"),
         lambda r: f"recipes/{r.recipe}.py asked for fp8 with torchao, and Accelerate resolved mixed_precision="
                   f"{r.resolved_precision!r}, backend {r.fp8_backend}: this device has no FP8 support (a GPU needs "
                   "compute capability 8.9+: Ada or Hopper)",
         lambda r: "use recipes/mixed_precision.py --mixed_precision bf16 instead", built=True),
    Rule(lambda r: r.fp8_converted == 0,
         lambda r: "no nn.Linear was converted to Float8Linear (the model's Linears kept: "
                   f"{r.fp8_kept or 'none'}; GPT-2's blocks are Conv1D, not nn.Linear), so this would train in plain "
                   "bf16",
         lambda r: "use a model built from nn.Linear (BERT, ViT, Llama), or recipes/mixed_precision.py "
                   "--mixed_precision bf16", built=True),
    # Mixtral's experts are 3-D parameters, no nn.Linear (found by benchmarks/decoder_presets.py)
    Rule(lambda r: bool(r.linear_only and r.outside_linear),
         lambda r: f"recipes/{r.recipe}.py {r.linear_only} the nn.Linear layers of the transformer blocks, and the "
                   f"{r.model_type or 'model'} blocks' {r.outside_linear} are not nn.Linear layers (a mixture of "
                   "experts' stacked expert weights and router): they would silently stay as they are",
         lambda r: "use a dense model (--model_preset tiny-llama, or a Llama / Mistral / GPT-2 checkpoint), or train "
                   "the mixture of experts in full precision: recipes/baseline.py, zero.py, fsdp.py, or "
                   "recipes/combined.py --lora (PEFT's LoRA adapts the experts too)", built=True),
)


def _hsdp(r: Run) -> str:  # the HSDP flags given, as typed ("": none)
    return " ".join(f"--{k} {v}" for k, v in (("dp_replicate_size", r.dp_replicate_size),
                                              ("dp_shard_size", r.dp_shard_size)) if v)


def _hsdp_sizes(r: Run) -> tuple[float, float]:  # (replicas, processes per replica); unset: n over the other
    n, replicas, shard = r.num_processes, r.dp_replicate_size, r.dp_shard_size
    return replicas or n / shard, shard or n / replicas


def _hsdp_fills(r: Run) -> bool:
    replicas, shard = _hsdp_sizes(r)
    return replicas * shard == r.num_processes and replicas % 1 == shard % 1 == 0


def _unsplit(r: Run, degree: int, **sizes: int) -> str:
    """The first of `sizes` that `degree` does not divide, in words ("": all split)."""
    words = {"heads": "attention heads", "kv_heads": "key/value heads", "mlp_width": "MLP width", "experts": "experts"}
    return next((f"{words[k]} ({v})" for k, v in sizes.items() if v and v % degree), "")


def refusals(run: Run) -> list[str]:
    """Every rule the run breaks, as 'problem. Fix: ...' sentences (empty: it trains)."""
    if run.recipe not in RECIPES:
        return [f"recipes/{run.recipe}.py is not in shared/core/rules.py's RECIPES table. Fix: add its row there."]
    found = [(rule.reason(run), rule.fix(run)) for rule in RULES if rule.applies(run)]
    return [f"{reason}. Fix: {fix[0].upper()}{fix[1:]}." for reason, fix in found]


def check(run: Run) -> None:
    """Stop (SystemExit) before anything is loaded when the run breaks a rule."""
    found = refusals(run)
    if found:
        raise SystemExit("Refused before training: " + " ".join(found))


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
        raise SystemExit("Refused before training: " + " ".join(found))


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


def launched_sharding(env: Mapping[str, str] = os.environ) -> tuple[str, str, int]:
    """(sharding, offload, processes) the launch config asked for, from the variables `accelerate launch` sets."""
    world = int(env.get("WORLD_SIZE", "1"))
    if _env_true(env, "ACCELERATE_USE_DEEPSPEED"):
        devices = {env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{p}_DEVICE", "none").lower() for p in ("OPTIMIZER", "PARAM")}
        offload = "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
        return f"zero{env.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}", offload, world
    if _env_true(env, "ACCELERATE_USE_FSDP"):
        return "fsdp", "cpu" if _env_true(env, "FSDP_OFFLOAD_PARAMS") else "none", world
    return ("ddp" if world > 1 else "none"), "none", world


def deepspeed_sharding(ds_config: dict) -> tuple[str, str]:
    """(sharding, offload) of a resolved DeepSpeed config."""
    zero = ds_config.get("zero_optimization", {})
    devices = {(zero.get(p) or {}).get("device", "none") for p in ("offload_optimizer", "offload_param")}
    return f"zero{zero.get('stage', 0)}", "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"


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
        return deepspeed_sharding(accelerator.state.deepspeed_plugin.deepspeed_config)[1]
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
