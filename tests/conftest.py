"""Which tests run between edits (`pytest -m "not full"`) and which only in the full run (`pytest -m full`).

Every test is fast unless a pattern of FULL matches its node id. FULL is read top to bottom and the first match
decides: an entry whose reason starts with "fast:" keeps the tests it matches fast (a representative case before the
pattern that sends its siblings to the full run). New tests are fast until a line here says otherwise, so no test
file needs a mark of its own.

Module fixtures that launch many cases at once build only the cases this run selected (``selected_params``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import pytest

ZOO = "tests/test_zoo.py::test_*_ranks_match_one_process"
# (node-id pattern, reason). fnmatch syntax: "[" in an id is written "[[]".
FULL: list[tuple[str, str]] = [
    # The model zoo: one model of each structural kind under each layout kind stays fast.
    (f"{ZOO}[[]llama-tp2]", "fast: separate q/k/v, untied, tensor parallel"),
    (f"{ZOO}[[]phi3-tp2]", "fast: fused q/k/v and gate/up"),
    (f"{ZOO}[[]gpt2-tp2]", "fast: Conv1D, fused [q; k; v], tied, a vocabulary the degree does not divide"),
    (f"{ZOO}[[]mixtral-tp2]", "fast: mixture of experts (fused 3-D experts)"),
    (f"{ZOO}[[]deepseek_v3-tp2]", "fast: latent attention split by heads"),
    (f"{ZOO}[[]bamba-tp2]", "fast: state-space hybrid (Mamba-2 mixers beside attention)"),
    (f"{ZOO}[[]litgpt_llama-tp2]", "fast: LitGPT"),
    (f"{ZOO}[[]llama_tied-pp2]", "fast: a tied embedding and head on two stages"),
    (f"{ZOO}[[]bamba-pp2]", "fast: a block stack of mixed classes split into stages"),
    (f"{ZOO}[[]litgpt_llama-pp2]", "fast: LitGPT's rotary tables passed to every stage"),
    (f"{ZOO}[[]mixtral-dp2-zero3]", "fast: experts sharded by ZeRO-3"),
    (f"{ZOO}[[]litgpt_llama-dp2-zero1]", "fast: ZeRO-1"),
    (f"{ZOO}[[]gpt2-tp2-pp2]", "fast: four ranks, tensor x pipeline, tied"),
    (f"{ZOO}[[]gemma_mqa-tp4]", "fast: fewer key/value heads than ranks"),
    (f"{ZOO}[[]gemma_mqa-dp2-tp2-zero3]", "fast: shared key/value heads under ZeRO-3"),
    (f"{ZOO}[[]*]", "the rest of the model zoo (~150 cases; 7-10 min)"),
    ("tests/test_zoo.py::test_tied_weights_stay_tied_under_every_schedule_and_zero",
     "a tied model under all seven schedules (the schedules are fast in tests/pipeline)"),
    ("tests/test_zoo.py::test_litgpt_under_every_schedule", "LitGPT under all seven schedules"),
    ("tests/test_zoo.py::test_module_dict_keys_other_than_positions_under_sequence_parallelism",
     "ModuleDict keys other than positions at tp2 (the zoo's torchtitan-style cases are in this set too)"),
    ("tests/test_zoo.py::test_blocks_reading_values_from_before_the_stack_*", "Gemma 3n / Zamba2 on 2 and 4 ranks"),
    # torch.compile: inductor builds C++ for every case, in one launch; test_replicate's compiled DDP case and
    # test_regions' compiled regions stay fast.
    ("tests/test_compile.py::test_compiled_*train*", "each kind of layout compiled, against eager runs"),
    ("tests/test_compile.py::test_compiled_tensor_parallel_blocks_take_new_sequence_lengths*",
     "recompiles per sequence length"),
    # Pretrained weights: ten families saved, trained at tp2 (four of them at tp2 x pp2 too) and exported.
    ("tests/checkpointing/test_hf.py::test_pretrained_round_trip[[]llama_tied-tp2]", "fast: tied, meta init, export"),
    ("tests/checkpointing/test_hf.py::test_pretrained_round_trip[[]mixtral-tp2-pp2]",
     "fast: experts, four ranks"),
    ("tests/checkpointing/test_hf.py::test_pretrained_round_trip[[]*]", "the other families' round trips"),
    ("tests/checkpointing/test_hf.py::test_legacy_moe_files_are_read_per_expert",
     "Mixtral's files as transformers writes them"),
    # Layouts covered fast by a sibling or another file; each case is one launch of its own.
    ("tests/test_logged_reductions.py::*[[]dp2-tp2]", "data parallelism beside TP (pp2 and tp2 x pp2 are fast)"),
    ("tests/test_logged_reductions.py::*[[]tp2]", "tp2 x pp2 is fast (the same groups, and the pipeline's)"),
    ("tests/test_real_setups.py::test_lightning_precision_strings_become_mesh_aware[[]bf16-mixed-*]",
     "bf16-true (the same plugin) and 16-mixed are fast"),
    ("tests/test_architecture.py::test_every_module_imports_first_in_a_fresh_interpreter",
     "every module first in a fresh interpreter (~30 s; the layering test beside it is fast)"),
    ("tests/test_parity.py::test_gpt_layouts_match_single_process[[]tp2-nosp]", "sequence parallelism off"),
    ("tests/test_parity.py::test_gpt_layouts_match_single_process[[]dp2-zero3-offload]",
     "CPU offload (DeepSpeed's is fast)"),
    ("tests/test_parity.py::test_gpt_layouts_match_single_process[[]tp2-dp2-zero0]", "tp2-dp2-zero3 is fast"),
    ("tests/test_parity.py::test_transformers_llama_layouts_match_single_process*",
     "the example GPT's layouts again on transformers' Llama (the zoo's Llama cases are fast)"),
    ("tests/test_parity.py::test_accumulation_and_global_norm_clipping[[]tp2]", "tp2-dp2-zero3 is fast"),
    ("tests/test_parity.py::test_accumulation_and_global_norm_clipping[[]dp2-zero0]", "tp2-dp2-zero3 is fast"),
    ("tests/test_parity.py::test_users_forward_hooks_see_the_output_the_model_goes_on_with[[]tp2-nosp]",
     "sequence parallelism off (tp2 is fast)"),
    ("tests/pipeline/test_pipeline.py::test_v_schedules_validate_between_steps[[]DualPipeV]",
     "the other V (ZBVZeroBubble is fast)"),
    ("tests/pipeline/test_pipeline.py::test_pipeline_composes_with_tp_and_zero[[]pp2-tp2]",
     "the zoo's tp2-pp2 is fast"),
    ("tests/pipeline/test_pipeline.py::test_pipeline_composes_with_tp_and_zero[[]pp2-dp2-zero1]",
     "dp2-tp2-pp2 is fast"),
    ("tests/pipeline/test_pipeline.py::test_pipeline_composes_with_tp_and_zero[[]pp2-dp2-zero3]",
     "dp2-tp2-pp2 is fast"),
    ("tests/pipeline/test_pipeline.py::test_transformers_llama_pipeline_without_any_hook[[]pp2-dp2-zero3]",
     "pp2 is fast"),
    ("tests/pipeline/test_pipeline.py::test_pipeline_accumulation_and_global_clipping[[]pp2-dp2-zero3]",
     "pp2-dp2-zero2-1f1b is fast"),
    ("tests/pipeline/test_pipeline.py::test_pipeline_accumulation_and_global_clipping[[]pp2-tp2]",
     "pp2-dp2-zero2-1f1b is fast"),
    ("tests/context_parallel/test_context_parallel.py::test_context_parallel_is_exact[[]8-*]", "the eight-rank launch"),
    ("tests/context_parallel/test_context_parallel.py::test_context_parallel_is_exact[[]4-qwen3-cp2_pp2_padded_tokens]",
     "fast: context x pipeline parallelism on padded rows weighed by tokens"),
    ("tests/context_parallel/test_context_parallel.py::test_context_parallel_is_exact[[]4-*]",
     "the rest of the four-rank launch: cp2 x tp2, Llama and ZBV at cp2 x pp2 (cp2 ring and Ulysses on two stay fast)"),
    ("tests/tensor_parallel/test_plan_errors.py::test_plan_order_does_not_depend_on_the_hash_seed",
     "three fresh interpreters under different hash seeds"),
    ("tests/expert_parallel/test_expert_parallel.py::test_expert_parallel_is_exact[[]4-*]",
     "the four-rank launch: experts with TP, PP and ZeRO over four (the two-rank cases, ZeRO-3 among them, are fast)"),
    ("tests/expert_parallel/test_expert_parallel.py::test_expert_parallel_is_exact[[]8-*]", "the eight-rank launch"),
    ("tests/expert_parallel/test_expert_parallel.py::test_routing_metrics_under_a_pipeline_count_each_step_once",
     "the four-rank launch's results"),
    ("tests/precision/test_precision.py::test_precision_tracks_fp32_under_layouts[[]bf16-mixed-pp2-tp2]",
     "bf16 on two layouts is fast"),
    ("tests/precision/test_precision.py::test_precision_tracks_fp32_under_layouts[[]fp16-pp2]",
     "fp16-tp2-dp2-zero3 is fast"),
    ("tests/precision/test_precision.py::test_precision_tracks_fp32_under_layouts[[]fp8-tensorwise-tp2-dp2-zero3]",
     "fp8 rowwise is fast; bf16/fp8 matmuls are slow on CPU"),
    ("tests/precision/test_precision.py::test_precision_tracks_fp32_under_layouts[[]fp8-pp2]", "fp8 rowwise is fast"),
    ("tests/precision/test_precision.py::test_fp8_weights_gathered_in_fp8_are_scaled_as_one_process_scales_them",
     "four ranks, four runs (25 s); FP8 under ZeRO-3 and the rowwise refusal are fast"),
    ("tests/data_parallel/test_compression.py::test_lossless_settings_reproduce_single_process[[]dp2-zero1-powersgd-*]",
     "lossless top-k is fast"),
    ("tests/data_parallel/test_compression.py::test_lossless_settings_reproduce_single_process[[]pp2-dp2-zero1-topk1]",
     "lossless top-k is fast"),
    ("tests/data_parallel/test_compression.py::test_lossy_compressors_train_like_uncompressed[[]dp2-zero0-fp16]",
     "int8 and PowerSGD are fast"),
    ("tests/data_parallel/test_compression.py::test_lossy_compressors_train_like_uncompressed[[]dp2-zero2-bf16]",
     "int8 and PowerSGD are fast"),
    ("tests/data_parallel/test_compression.py::test_lossy_compressors_train_like_uncompressed[[]dp2-zero1-topk]",
     "int8 and PowerSGD are fast"),
    ("tests/data_parallel/test_compression.py::test_resume_restores_compressor_state[[]topk]", "PowerSGD's is fast"),
    ("tests/data_parallel/test_deepspeed.py::test_deepspeed_zero_matches_single_process[[]zero1]",
     "zero2/zero3 are fast"),
    ("tests/data_parallel/test_deepspeed.py::test_deepspeed_zero_matches_single_process[[]zero3-offload-all]",
     "optimizer offload is fast"),
    ("tests/activation_checkpointing/test_activation_checkpoint.py::test_budget_mode_fits_and_recomputes_less_as_it_grows",
     "several budgets, each measured"),
    ("tests/activation_checkpointing/test_activation_checkpoint.py::test_checkpointing_under_parallel_layouts[[]tp2-dp2-zero3-budget]",
     "budget mode on four ranks"),
    ("tests/fault_tolerance/test_fault_tolerance.py::test_killed_rank_resumes_to_the_uninterrupted_result[[]trial2]",
     "a third kill point, at the first step (trial0 and trial1, killed in and out of a save, are fast)"),
    ("tests/test_planner.py::test_predicted_peaks_are_within_ten_percent_of_measured_ones",
     "measures eleven real layouts"),
    ("tests/test_planner.py::test_two_ranks_under_bf16_autocast_peak_near_the_prediction",
     "four two-rank layouts in bf16, measured (plan() itself is fast)"),
    ("tests/test_planner.py::test_one_process_under_bf16_autocast_peaks_where_predicted",
     "one process in bf16 at several sizes, measured (plan() itself is fast)"),
    ("tests/cli/test_quiet_run.py::test_main_job_prints_each_warning_once", "the eight-process main job"),
    ("tests/tensor_parallel/test_regions.py::test_compiled_regions_stay_exact_whatever_they_do_with_their_input*",
     "compiled regions changing, copying or gating their input (compiled DDP blocks stay fast in test_replicate)"),
    ("tests/tensor_parallel/test_anomaly_mode.py::test_detect_anomaly_under_tensor_parallelism_trains_as_one_process",
     "torch.autograd.detect_anomaly at tp2 (a debugging mode; tp2 itself is fast everywhere)"),
    ("tests/test_real_setups.py::test_fused_adamw_on_tied_frozen_and_padded_models_matches_one_process",
     "torch's fused AdamW kernel against its loop on four models (the default optimizer path is in every fast test)"),
    ("tests/cli/test_cli.py::test_cli_resumes_mid_epoch_on_the_batches_of_an_unstopped_run",
     "three llmpar fit runs, stopped and resumed mid-epoch (the resumable position is fast in test_data_position)"),
    ("tests/test_gpu_bench.py::test_dry_run_exercises_every_section_on_cpu",
     "the GPU benchmark's every section on a tiny model on CPU (its ring emulation is checked fast)"),
    ("tests/test_planner.py::test_llmpar_plan_writes_a_config_that_llmpar_fit_trains",
     "plans, writes and trains a config through two subprocesses (plan() itself is fast)"),
    ("tests/expert_parallel/test_expert_parallel.py::test_load_balancing_losses_under_a_pipeline_are_refused",
     "two two-rank launches refused at set-up and at the first step"),
    ("tests/test_guards.py::test_parity_check_refuses_microbatches_that_do_not_divide_the_batch",
     "a two-rank parity check refused at its first step (fit's own check is fast in tests/pipeline)"),
    ("tests/cli/test_quiet_run.py::test_llmpar_plan_of_a_transformers_model_says_only_the_plan",
     "a 10-20 s subprocess that imports transformers and torchao"),
    ("tests/test_real_setups.py::test_lora_under_tensor_parallelism_matches_one_process",
     "LoRA on seven families at tp2 and three four-rank layouts (LoRA with clipping and under EP stays fast)"),
    # The command end to end: each run imports Lightning, transformers and torch once per process (~20-40 s). A run
    # with nothing optional and the quiet first run stay fast.
    ("tests/cli/test_cli.py::test_cli_override_to_pipeline_parallel_draws_the_timeline",
     "a pipeline run overridden on the command line, drawing its timeline (pipelines are fast in tests/pipeline)"),
    ("tests/test_guards.py::test_llmpar_verify_passes_on_a_good_layout",
     "llmpar verify in a subprocess (verify_parity itself is fast in this file)"),
    ("tests/cli/test_cli.py::test_litgpt_example_fine_tunes", "the LitGPT example (LitGPT is fast in the zoo)"),
    ("tests/cli/test_cli.py::test_hugging_face_example_fine_tunes_and_exports",
     "the Hugging Face example (its config is built fast; pretrained weights are fast in test_hf)"),
    # Loss parallelism, background saves, replica groups: one case of each stays fast.
    ("tests/tensor_parallel/test_loss_parallel.py::test_loss_parallel_with_pipeline_zero_and_context_parallelism",
     "four ranks: tp2 x pp2, dp2 x tp2 x ZeRO-3, cp2 x tp2 (the example GPT's tp2 case is fast)"),
    ("tests/tensor_parallel/test_loss_parallel.py::test_logit_scale_reentrant_checkpoint_and_compiled_loss_exact_*",
     "scaled logits, reentrant checkpointing and a compiled loss on split logits (the example GPT's tp2 case is fast)"),
    ("tests/checkpointing/test_hf.py::test_checkpoints_of_split_fused_and_tied_weights_reshard",
     "split, fused and tied weights resharded between layouts (resuming in another layout is fast in test_checkpoint)"),
    ("tests/tensor_parallel/test_loss_parallel.py::test_zoo_families_exact_with_loss_parallel_at_tp2",
     "four families with loss_parallel=True (the zoo's fast tp2 slice runs loss parallel by default)"),
    ("tests/checkpointing/test_async_checkpoint.py::test_async_saves_resume_exactly_as_synchronous_saves[[]tp2]",
     "background saves at tp2 (dp2 ZeRO-3 stays fast)"),
    ("tests/checkpointing/test_async_checkpoint.py::test_async_saves_resume_exactly_as_synchronous_saves[[]pp2]",
     "background saves at pp2 (dp2 ZeRO-3 stays fast)"),
    ("tests/fault_tolerance/test_torchft.py::*2ranks-zero3]", "replica groups of two ranks with ZeRO-3 (one rank each stays fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_two_groups_without_failures_match_one_process[[]1rank]",
     "two one-rank groups on the example regression (the same on transformers' Llama stays fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_three_groups_match_one_process_and_two_survive_a_third",
     "three replica groups, one killed (two groups, killed and healed, stay fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_a_dead_lighthouse_stops_every_group_and_checkpoints_carry_the_run_on*",
     "a dead lighthouse, then resuming from checkpoints: waits out a 20 s quorum timeout (killed groups heal in the fast set)"),
    ("tests/fault_tolerance/test_torchft.py::test_diloco_groups_part_between_syncs_and_meet_at_each",
     "DiLoCo between two-rank ZeRO-3 groups (DiLoCo at H=1 with one rank each stays fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_diloco_resumed_at_a_sync_step_goes_on_as_the_uninterrupted_run",
     "DiLoCo stopped and resumed at a sync step (DiLoCo at H=1 stays fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_a_lighthouse_address_nothing_listens_on_is_reported_*",
     "a lighthouse address nothing listens on, waited out to the connect timeout"),
    ("tests/fault_tolerance/test_torchft.py::test_a_group_that_starts_alone_says_so",
     "a replica group started alone warns (the heal test, fast, starts both groups together)"),
    ("tests/data_parallel/test_deepspeed.py::test_pretrained_weights_are_loaded_under_the_engine",
     "transformers Llama through the engine at ZeRO-1 and meta-device ZeRO-3 (pretrained weights are fast in test_hf)"),
    ("tests/data_parallel/test_deepspeed.py::test_activation_checkpointing_recomputes_under_the_engine*",
     "two two-rank engine runs (activation checkpointing is fast under fsdp2)"),
    ("tests/data_parallel/test_deepspeed.py::test_deepspeed_does_not_clip_unless_asked",
     "DeepSpeed without gradient_clip_val against one process on steep gradients (the clipping test stays fast)"),
    ("tests/data_parallel/test_deepspeed.py::test_deepspeed_checkpoint_exports_every_parameter[[]0]",
     "exporting a DeepSpeed ZeRO-0 checkpoint (ZeRO-1's with a frozen block and ZeRO-3's stay fast)"),
    ("tests/data_parallel/test_deepspeed.py::test_deepspeed_steps_where_lightning_ends_an_accumulation_group[[]zero[03]*]",
     "ZeRO-0 and offloaded ZeRO-3 on an epoch's short group (ZeRO-1, which crashed, stays fast)"),
    ("tests/test_logged_reductions.py::*[[]cp2-pp2]", "cp2 x pp2's evaluation groups (cp2 is fast)"),
    ("tests/context_parallel/test_context_parallel.py::test_context_parallel_is_exact[[]2-gemma2_full-ring]",
     "Gemma-2 at cp2 (its refusals are fast)"),
    ("tests/test_real_setups.py::test_lora_export_folds_the_adapters_as_peft_merges_them",
     "LoRA exports against peft's own merge at tp2 and pp2"),
    ("tests/precision/test_precision.py::test_plugins_under_lightnings_own_strategy",
     "FP8 and bf16 'true' under Lightning's own strategy (the plugins under ours stay fast)"),
    ("tests/fault_tolerance/test_torchft.py::test_a_group_restarted_into_running_diloco_is_refused*",
     "a group restarted into a running DiLoCo job, refused (killed groups heal in the fast set)"),
    ("tests/fault_tolerance/test_torchft.py::test_groups_started_apart_wait_for_each_other",
     "a second group started after the first reached its first step (the fast heal test's restarted group passes"
     " the same wait, finding the other heartbeating)"),
    ("tests/test_harness.py::test_a_script_starting_ranks_without_a_main_guard_is_told_so",
     "a script run in a subprocess (the launcher's other message is fast)"),
    ("tests/checkpointing/test_user_files.py::test_an_export_in_another_dtype_says_so_in_its_config",
     "two trainings and two loads for an export's dtype"),
    ("tests/context_parallel/test_context_parallel.py::test_context_parallel_is_exact[[]4-qwen2-cp2_dp2_zero3[]]",
     "cp2 x dp2 on four ranks (cp2 on two ranks is fast)"),
    ("tests/checkpointing/test_rank_state.py::test_a_callbacks_sharded_state_resumes_as_one_process_continues[[]zero3]",
     "a sharded EMA resumed at ZeRO-3 (tp2's DTensor shards and pp2's stage-local state stay fast)"),
    ("tests/checkpointing/test_rank_state.py::test_an_averaged_model_of_the_tensor_parallel_model_averages_as_one_process",
     "torch's AveragedModel at tp2 against one process"),
    ("tests/checkpointing/test_rank_state.py::test_another_pipeline_schedule_is_another_layout_for_stage_local_state",
     "a pipeline schedule changed on resume (a changed layout is refused in the fast set)"),
    ("tests/checkpointing/test_rank_state.py::test_trusted_checkpoints_holding_what_the_safe_loader_refuses_*",
     "two runs for the trusted resume scan"),
    ("tests/fault_tolerance/test_checkpoint_safety.py::test_planted_payload_never_runs_and_the_folder_is_skipped[[]rank_state0.pt]",
     "a payload in a per-rank state file (the same check as compression_rank0.pt's, fast)"),
]


def full_reason(nodeid: str) -> str | None:
    """Why ``nodeid`` runs only under ``-m full``; None when it is fast."""
    for pattern, reason in FULL:
        if fnmatchcase(nodeid, pattern):
            return None if reason.startswith("fast:") else reason
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = full_reason(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.full(reason=reason))
    if not config.args or config.args == ["tests"]:  # the whole suite: a pattern naming no test is a stale line
        stale = [p for p, _ in FULL if not any(fnmatchcase(item.nodeid, p) for item in items)]
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if stale and reporter is not None:  # printed, not warned: pyproject ignores UserWarnings
            reporter.write_line(f"tests/conftest.py: FULL patterns that name no test: {stale}", yellow=True)


@pytest.fixture(scope="module")
def selected_params(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The parameters of this module's tests that this run runs (after ``-m`` and ``-k``), for fixtures that
    launch many cases at once to launch only those."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "module", None) is request.module and hasattr(item, "callspec")]
