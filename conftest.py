# The testing kit's fixtures (model_server, runner, procs, local_sandbox, toolset_harness) for every
# test folder of this repository; a plugin's own tests/conftest.py holds only that plugin's fixtures.
pytest_plugins = ["hermes_batch.testing.fixtures"]

# What each test needs besides Python, as markers (registered in pyproject.toml; docs/internals.md#tests):
# `scripts/test.sh` deselects the tests marked with any of them, `scripts/test.sh --all` runs them all, the
# `perf` ones one at a time.  This file marks them, so that a test says what it needs by the fixtures it
# asks for and the tables below are the only other place:
#
#   docker     a Docker engine and the busybox test images (scripts/docker.sh)
#   apptainer  Apptainer, run in a Docker container (scripts/apptainer.sh)
#   modal      the modal sandbox against the local Modal stand-in, whose sandboxes are Docker containers
#   ray        Ray (installed by scripts/test.sh --all); most start a local Ray cluster of two nodes
#   browser    Debian's Chromium (scripts/chromium.sh), through Playwright
#   slow       takes about a second or more on an idle 2-core machine: whole runs, resumes, child processes, timeouts
#              (the everyday run keeps at least one such test per area, so it still catches a broken feature)
#   perf       compares times or memory, so it runs alone: in parallel with other tests it may fail for nothing

import os

import pytest

NEEDS = ("docker", "apptainer", "modal", "ray", "browser", "slow", "perf")

# A fixture (asked for by the test or by a fixture it uses) -> what a test that uses it needs.
NEEDS_OF_FIXTURES = {
    "docker_api": "docker",  # hermes_batch_docker/tests
    "apptainer_bin": "apptainer",  # hermes_batch_singularity/tests
    "docker_engine": "modal",  # hermes_batch_modal/tests: the stand-in and its engine
    "ray_cluster": "ray",  # plugins/hermes_batch_ray/tests
    "browser": "browser",  # tests/view_rig.py and the toolbox's browser tests
    "page": "browser",
}

# Tests (a file, file::name for every parametrisation of one test, file::name[id] for one, file::Class or
# file::Class::name) -> what they need that no fixture says:
# the tests that drive Chromium without a fixture of it, long runs, and those that compare times.
NEEDS_OF_TESTS = {
    "hermes_batch_docker/tests/test_docker_runner.py": ("docker",),  # backends made in the test, not docker_api
    "plugins/hermes_batch_toolbox/tests/test_browser.py": ("browser",),
    "plugins/hermes_batch_toolbox/tests/test_end_to_end.py::test_thirty_prompts_with_every_toolset": ("browser",),
    "tests/test_view_guard.py::test_a_rebound_name_reads_nothing_in_chromium": ("browser",),
    # slow: runs of hermes-batch in child processes, worker processes, big files (more than ~5 s on a busy machine)
    "tests/test_record_schema.py": ("slow",),  # a run of 2,900 prompts, made once for the module
    "tests/test_logprobs.py::test_the_side_file_resumes_with_the_records": ("slow",),  # two runs; the others keep one
    "tests/test_replay_journal.py::test_sigkill_at_every_turn_boundary_resumes_without_paying_again": ("slow",),
    "tests/test_replay_journal.py::test_a_tool_that_prints_something_else_sends_exactly_the_remainder": ("slow",),
    "tests/test_replay_journal.py::test_ctrl_c_at_turn_boundaries_resumes_without_paying_again": ("slow",),
    "tests/test_replay_journal.py::test_processes_executor_replays_through_its_driver": ("slow",),
    "tests/test_replay_journal.py::test_a_journal_torn_by_a_kill_is_read_up_to_its_last_whole_entry": ("slow",),
    "tests/test_replay_journal.py::test_response_cache_answers_a_second_run_folder": ("slow",),
    "tests/test_batch_api.py::test_a_resume_collects_the_batches_in_flight_instead_of_sending_them_again": ("slow",),
    "tests/test_batch_api.py::test_a_resume_replays_the_journaled_turns_and_collects_the_batch_in_flight": ("slow",),
    # Ray itself, which scripts/test.sh installs with --all only (it needs no cluster)
    "plugins/hermes_batch_ray/tests/test_ray_executor.py::test_an_unreachable_cluster_is_one_sentence_and_exit_status_2": ("ray",),
    "plugins/hermes_batch_ray/tests/test_ray_executor.py::test_driver_killed_mid_session_replays_the_journaled_answers_on_resume":
        ("slow",),  # two runs of ten-turn sessions in child processes, about two minutes
    # slow: many prompts
    "tests/test_batch_api.py::test_a_batch_run_makes_the_trajectories_of_a_synchronous_run": ("slow",),  # 2 x 200 prompts
    "plugins/hermes_batch_toolbox/tests/test_open_files.py": ("browser", "slow"),  # 1000 prompts, 200 with a browser
    # slow: a user made for the test runs pytest again
    "tests/test_local_boundary.py::test_the_hostile_classes_hold_for_a_runner_without_root": ("slow",),
    "tests/test_process_executor.py": ("slow",),  # every test starts worker processes
    # slow: runs of 60 to 80 prompts for the provider guard; its unit tests run in the everyday suite
    "tests/test_provider_guard.py::test_a_bad_provider_is_excluded_in_a_run_and_stays_excluded_on_resume": ("slow",),
    "tests/test_ctl.py::test_ctl_steers_a_running_run_and_stop_resumes": ("slow",),  # a run in a child process, steered
    "tests/test_provider_guard.py::test_a_resume_refuses_a_hostile_provider_guard_json": ("slow",),  # two runs
    "tests/test_task_folders.py::test_a_sandbox_without_images_refuses_a_task_before_any_model_call": ("slow",),  # a run
    "tests/test_accounting.py::test_sigkill_then_resume_counts_every_request_the_endpoint_served": ("slow",),
    "tests/test_branches.py::test_a_kill_mid_branch_pays_neither_the_prefix_nor_a_finished_branch_again": ("slow",),
    "tests/test_branches.py::test_a_rows_prefix_answers_die_with_its_last_branch_unless_one_failed": ("slow",),
    "tests/test_adaptive.py::test_a_killed_adaptive_run_resumes_without_running_a_finished_sample_again": ("slow",),
    "tests/test_adaptive.py::test_a_run_the_budget_stopped_resumes_to_the_same_decisions_without_paying_twice":
        ("slow",),
    "tests/test_engine.py::test_hundreds_of_sessions_at_once": ("slow", "perf"),  # 300 sessions within 20 s
    "tests/test_export.py::test_a_killed_export_leaves_the_old_set_or_the_new_and_the_next_cleans_up": ("slow",),
    "tests/test_export.py::test_a_switch_killed_between_renames_is_finished_by_the_next_export": ("slow",),
    "tests/test_export.py::test_several_runs_export_as_one_dataset_with_one_schema": ("slow",),
    "tests/test_hostile_tools.py::test_file_tools_on_a_fifo_end_at_once_and_the_run_exits": ("slow",),
    "tests/test_hostile_tools.py::test_the_same_call_in_the_default_executor_would_hang_the_exit": ("slow",),
    "tests/test_limits.py::test_a_low_hard_limit_runs_fewer_prompts_at_once_instead_of_failing_them": ("slow",),
    "tests/test_limits.py::test_the_soft_limit_is_raised_to_the_hard_limit_at_start": ("slow",),
    "tests/test_merge.py::test_datasets_loads_a_big_file_whose_optional_fields_appear_late": ("slow",),
    "tests/test_model_transport.py::test_on_aiohttp_a_call_to_a_plain_http_endpoint_loads_no_transport_of_the_sdks":
        ("slow",),
    "tests/test_packaging.py::test_each_wheel_holds_only_its_own_package": ("slow",),
    "tests/test_plan.py::test_a_process_given_the_pickled_plan_processes_a_prompt_as_the_runner_would": ("slow",),
    "tests/test_plugin_kit.py::test_a_copy_of_the_example_plugin_passes_its_tests_outside_the_repository": ("slow",),
    "tests/test_plugin_kit.py::test_new_plugin_makes_a_distribution_whose_tests_pass": ("slow",),
    "tests/test_plugins.py::test_a_local_run_imports_no_library_only_other_plugins_use": ("slow",),
    "tests/test_refilter.py::test_a_resume_finishes_a_killed_refilter_and_pays_for_nothing": ("slow",),
    "tests/test_refilter.py::test_refilter_killed_at_any_stage_is_finished_by_running_it_again": ("slow",),
    "tests/test_refilter.py::test_refilter_waits_for_no_run_it_takes_the_run_folders_lock": ("slow",),
    "tests/test_refilter.py::test_resume_after_refilter_runs_no_finished_prompt": ("slow",),
    "tests/test_resume_durability.py::test_a_batch_finished_before_its_checkpoint_was_saved_is_complete_after_the_resume":
        ("slow",),
    "tests/test_resume_durability.py::test_a_failure_in_a_session_killed_before_any_checkpoint_is_cleared_by_the_resume":
        ("slow",),
    "tests/test_resume_durability.py::test_ctrl_c_shuts_down_cleanly_and_resume_completes": ("slow",),
    "tests/test_resume_durability.py::test_discarded_prompts_stay_finished_and_failed_prompts_run_again": ("slow",),
    "tests/test_resume_durability.py::test_sigkill_mid_run_then_resume_finishes_each_prompt_once_without_paying_twice":
        ("slow",),
    "tests/test_resume_durability.py::test_torn_last_line_is_repaired_and_its_prompt_runs_again": ("slow",),
    "tests/test_resume_durability.py::test_sigterm_shuts_down_cleanly_with_its_own_status": ("slow",),
    "tests/test_run_folder_safety.py::test_ctrl_c_during_the_merge_stops_it_at_once_and_leaves_consistent_files":
        ("slow",),
    "tests/test_run_folder_safety.py::test_no_model_request_goes_out_after_the_first_failed_write": ("slow",),
    "tests/test_run_folder_safety.py::test_a_lock_left_by_a_killed_run_is_taken_over": ("slow",),
    "tests/test_run_folder_safety.py::test_a_file_size_limit_is_reported_as_a_write_error_and_resume_finishes": ("slow",),
    "tests/test_run_folder_safety.py::test_a_second_run_on_the_same_folder_refuses_at_once_naming_the_first": ("slow",),
    "tests/test_run_folder_safety.py::test_a_reindex_that_cannot_write_is_a_write_error_and_the_old_files_stay": ("slow",),
    "tests/test_secrets.py::test_a_local_command_cannot_read_the_runners_secrets": ("slow",),
    "tests/test_model_layer.py::test_max_cost_stops_dispatching_lets_in_flight_prompts_finish_and_resume_continues":
        ("slow",),
    "tests/test_bookkeeping.py::test_a_resume_with_nothing_left_imports_no_model_sdk": ("slow",),
    "tests/test_view_guard.py::test_each_start_makes_its_own_token": ("slow",),
    # a second of a stuck regex beside a session of fifteen calls (keeps: the verifier stopped at its timeout)
    "tests/test_answer_regex.py::test_a_run_with_a_catastrophic_row_keeps_the_other_prompts_at_their_pace": ("slow",),
    # issue 45's hostile files and faults (keeps: each file's in-process tests of the same features)
    "tests/test_hostile_journals.py::test_a_journal_linked_to_a_device_is_refused_not_read_for_ever": ("slow",),
    "tests/test_hostile_journals.py::test_lines_of_any_shape_in_a_journal_never_stop_a_resume[batches.jsonl]":
        ("slow",),
    "tests/test_hostile_batches.py::test_a_results_file_that_decompresses_to_hundreds_of_megabytes_is_read_a_line_at_a_time":
        ("slow",),  # 300 MB decompressed under tracemalloc
    "tests/test_hostile_batches.py::test_a_line_that_is_not_json_in_the_results_costs_only_itself[anthropic]": ("slow",),
    "tests/test_hostile_batches.py::test_a_run_killed_while_requests_wait_for_their_batch_counts_only_what_the_endpoint_received":
        ("slow",),
    "tests/test_hostile_batches.py::test_a_batch_is_cut_to_the_providers_byte_limit_before_it_is_sent": ("slow",),
    "tests/test_hostile_batches.py::test_a_batch_the_endpoint_refuses_as_too_large_goes_out_in_pieces": ("slow",),
    "tests/test_hostile_cache.py::test_a_write_lock_held_by_another_process_does_not_hold_up_the_run": ("slow",),
    "tests/test_hostile_samples.py::test_a_billion_samples_a_row_run_and_resume_in_little_memory": ("slow",),
    "plugins/hermes_batch_filters/tests/test_filters.py::test_planted_near_duplicates_are_found_and_nothing_else": ("slow",),
    # slow, for the everyday run's minute: what takes a second or more when idle (measured with --durations). Each
    # file keeps a quicker test of its feature in the everyday run (named after the "keeps" of its group).
    "tests/test_third_party_plugin.py::test_a_batch_runs_with_the_plugins": ("slow",),  # a fresh venv, pip install
    "tests/test_third_party_plugin.py::test_the_backend_passes_the_sandbox_contract": ("slow",),
    "tests/test_third_party_plugin.py::test_the_installed_plugins_are_listed": ("slow",),
    # the local sandbox's contract in its fallback modes (keeps: the default mode, TestLocalSandboxContract)
    # slow: a NAT program attached per prompt, fetches that wait out a timeout (scripts/test.sh --all installs them)
    "tests/test_local_network.py::test_a_prompt_reaches_the_machines_loopback_through_the_nat_only_when_asked": ("slow",),
    "tests/test_local_network.py::test_the_nat_program_ends_with_its_sandbox": ("slow",),
    "tests/test_local_network.py::test_abstract_sockets_of_the_machine_and_of_other_prompts_are_out_of_reach": ("slow",),
    "tests/test_local_boundary.py::test_a_runner_without_root_in_a_privileged_group_is_refused_unless_it_allows_the_group":
        ("slow",),  # four backends started by another user
    "tests/test_local_boundary.py::test_a_command_that_signals_pid_1_is_ignored[bash]":
        ("slow",),  # (keeps: the one of the compiled helper) a whole run
    "tests/test_local_sandbox.py::TestLocalSandboxContractProcessMode": ("slow",),
    "tests/test_local_sandbox.py::TestLocalSandboxContractBashHelper": ("slow",),
    "tests/test_local_sandbox.py::TestLocalSandboxContract::test_exec_returns_when_the_command_ends_though_a_background_child_holds_its_output":
        ("slow",),
    "tests/test_local_sandbox.py::TestLocalSandboxContract::test_processes_that_left_the_session_die_at_close": ("slow",),
    "tests/test_local_sandbox.py::TestLocalSandboxContract::test_timeout_kills_the_whole_process_tree": ("slow",),
    "tests/test_local_sandbox.py::TestLocalSandboxContract::test_huge_files_keep_the_runners_memory_bounded": ("slow",),
    "tests/test_local_sandbox.py::test_close_never_kills_a_process_that_took_over_a_number_the_sandbox_used": ("slow",),
    "tests/test_local_sandbox.py::test_a_sandbox_closed_while_its_namespace_starts_leaves_no_process": ("slow",),
    "tests/test_local_sandbox.py::test_the_namespace_dies_with_a_runner_killed_by_sigkill": ("slow",),
    "tests/test_local_sandbox.py::test_a_folder_swapped_for_a_link_in_a_tight_loop_never_leads_out": ("slow",),
    # (keeps: test_openai_batch_endpoints_through_the_sdk and test_a_request_failing_inside_a_batch_is_retried_in_a_later_one)
    "tests/test_batch_api.py::test_anthropic_message_batches_through_the_sdk": ("slow",),
    "tests/test_batch_api.py::test_an_expired_batch_sends_its_requests_again": ("slow",),
    # (keeps: their runs under the local executor) worker processes take seconds to start
    "tests/test_batch_api.py::test_prompt_timeout_applies_to_a_session_waiting_for_its_batch[processes]": ("slow",),
    "tests/test_batch_api.py::test_a_request_cut_off_by_prompt_timeout_leaves_the_batch_being_filled[processes]":
        ("slow",),
    # (keeps: test_prompt_timeout_applies_to_a_session_waiting_for_its_batch)
    "tests/test_batch_api.py::test_prompt_timeout_before_the_first_answer_fails_the_prompt": ("slow",),
    # (keeps: test_the_first_model_request_does_not_wait_for_the_sandbox and the quick ones)
    "tests/test_sandbox_start.py::test_a_deadline_while_the_sandbox_opens_still_closes_it": ("slow",),
    "tests/test_sandbox_start.py::test_a_late_backend_opens_at_the_first_tool_call": ("slow",),
    "tests/test_sandbox_start.py::test_a_sandbox_that_cannot_open_fails_the_prompts_that_call_a_tool": ("slow",),
    "tests/test_sandbox_start.py::test_waiting_for_the_sandbox_is_not_on_the_tool_calls_clock": ("slow",),
    # (keeps: test_a_resume_that_adds_batches_appends_them_to_the_merged_output)
    "tests/test_bookkeeping.py::test_a_damaged_or_stale_index_is_built_again_and_nothing_finished_runs_again": ("slow",),
    "tests/test_bookkeeping.py::test_a_merge_cut_off_is_completed_by_the_next_resume": ("slow",),
    "tests/test_bookkeeping.py::test_an_index_write_cut_off_leaves_the_old_index_and_the_resume_catches_up": ("slow",),
    "tests/test_bookkeeping.py::test_once_final_the_batch_files_can_go_and_a_resume_runs_only_new_prompts": ("slow",),
    "tests/test_bookkeeping.py::test_statistics_from_the_indexes_equal_a_full_scan_across_resumes_duplicates_failures_and_discards":
        ("slow",),
    # (keeps: test_a_row_inserted_at_the_top_renumbers_the_finished_records)
    "tests/test_reindex.py::test_a_changed_batch_size_regroups_the_batch_files": ("slow",),
    "tests/test_reindex.py::test_a_new_batch_size_over_the_same_dataset_moves_records_and_renumbers_none": ("slow",),
    "tests/test_reindex.py::test_a_reindex_cut_off_by_a_crash_is_finished_on_the_next_start": ("slow",),
    "tests/test_reindex.py::test_a_removed_row_sets_its_record_aside_and_a_restored_row_gets_it_back": ("slow",),
    "tests/test_reindex.py::test_an_unchanged_dataset_is_not_rewritten": ("slow",),
    "tests/test_reindex.py::test_no_index_of_a_file_a_cut_off_reindex_replaced_is_trusted": ("slow",),
    "tests/test_reindex.py::test_reordered_rows_keep_indexes_unique_and_run_only_the_rest": ("slow",),
    "tests/test_reindex.py::test_rows_removed_with_their_whole_batch_leave_no_index_behind": ("slow",),
    # (keeps: test_sharegpt_export_is_the_merged_records_and_loads_in_datasets)
    "tests/test_export.py::test_a_second_export_replaces_the_whole_set_of_the_first": ("slow",),
    "tests/test_export.py::test_an_existing_file_the_export_did_not_write_is_refused_unless_force": ("slow",),
    "tests/test_export.py::test_ctrl_c_waits_for_the_switch_of_the_files": ("slow",),
    "tests/test_export.py::test_export_never_writes_a_run_folders_records": ("slow",),
    "tests/test_export.py::test_include_discarded_and_all_in_prompt_index_order": ("slow",),
    # (keeps: test_a_looser_filter_brings_discarded_records_back)
    "tests/test_refilter.py::test_a_refilter_drops_the_indexes_of_the_files_it_rewrote_and_a_resume_counts_from_them":
        ("slow",),
    "tests/test_refilter.py::test_a_stricter_filter_moves_exactly_what_it_rejects": ("slow",),
    "tests/test_refilter.py::test_export_refuses_a_folder_with_an_unfinished_refilter": ("slow",),
    "tests/test_refilter.py::test_the_same_filters_change_nothing": ("slow",),
    # (keeps: test_statistics_cover_every_session_of_the_run and the quick ones)
    "tests/test_resume_durability.py::test_a_batch_with_a_failed_prompt_is_not_complete_until_a_resume_finishes_it": ("slow",),
    "tests/test_resume_durability.py::test_batch_numbers_are_fixed_whatever_order_prompts_finish_in": ("slow",),
    "tests/test_resume_durability.py::test_duplicated_prompts_run_once_per_row_across_resumes": ("slow",),
    "tests/test_resume_durability.py::test_reordered_and_extended_dataset_runs_only_the_new_rows": ("slow",),
    "tests/test_resume_durability.py::test_resume_of_a_finished_run_calls_no_model_and_rebuilds_outputs": ("slow",),
    # (keeps: test_a_resume_without_the_options_continues_with_those_of_run_json)
    "tests/test_resume_settings.py::test_a_limit_taken_from_run_json_can_be_lifted": ("slow",),
    "tests/test_resume_settings.py::test_a_resume_that_changes_the_model_is_refused_naming_both": ("slow",),
    "tests/test_resume_settings.py::test_a_run_whose_filter_discards_everything_says_so_at_start_and_at_the_end": ("slow",),
    "tests/test_resume_settings.py::test_allowed_changes_are_kept_per_session_and_the_statistics_name_every_model": ("slow",),
    "tests/test_resume_settings.py::test_no_word_when_the_filters_keep_most": ("slow",),
    "tests/test_resume_settings.py::test_the_ephemeral_system_prompt_is_compared_but_never_saved": ("slow",),
    # (keeps: the module's shared run and test_reasoning_disabled_turns_reasoning_off_in_the_request)
    "tests/test_run_end_to_end.py::test_a_second_run_into_a_used_folder_needs_resume_or_overwrite": ("slow",),
    "tests/test_run_end_to_end.py::test_dashed_option_spellings_work_like_the_underscored_ones": ("slow",),
    "tests/test_run_end_to_end.py::test_fifty_prompts_end_with_exit_0_and_merged_in_prompt_order": ("slow",),
    "tests/test_run_end_to_end.py::test_num_workers_prompts_run_at_the_same_time": ("slow",),
    "tests/test_run_end_to_end.py::test_provider_routing_reasoning_effort_and_max_tokens_reach_the_request": ("slow",),
    # (keeps: test_a_fatal_error_early_in_a_run_deletes_only_what_the_run_wrote and the quick ones)
    "tests/test_run_folder_safety.py::test_a_journal_that_cannot_be_written_stops_the_run_as_a_write_error": ("slow",),
    "tests/test_run_folder_safety.py::test_a_resume_on_a_disk_still_full_stops_before_paying_for_anything": ("slow",),
    "tests/test_run_folder_safety.py::test_a_run_folder_file_that_is_a_folder_is_one_sentence_and_the_lock_is_released":
        ("slow",),
    "tests/test_run_folder_safety.py::test_disk_full_stops_the_run_with_its_own_status_and_resume_finishes": ("slow",),
    "tests/test_run_folder_safety.py::test_leftovers_of_a_killed_session_are_removed_at_the_next_start_and_nothing_else":
        ("slow",),
    "tests/test_run_folder_safety.py::test_overwrite_never_follows_a_link_out_of_the_folder": ("slow",),
    "tests/test_run_folder_safety.py::test_overwrite_refuses_to_delete_the_dataset_it_is_about_to_read": ("slow",),
    "tests/test_run_folder_safety.py::test_overwrite_replaces_the_outputs_and_keeps_the_users_files": ("slow",),
    "tests/test_run_folder_safety.py::test_records_are_written_and_the_run_ends_while_tools_hold_every_pool_thread": ("slow",),
    "tests/test_run_folder_safety.py::test_every_file_of_the_run_folder_gets_the_users_umask": ("slow",),
    # (keeps: test_tool_errors_turn_limits_truncation_and_the_default_filters and the failing-prompt ones)
    "tests/test_run_model_behaviour.py::test_a_wrong_api_key_stops_the_run_at_once": ("slow",),
    "tests/test_run_model_behaviour.py::test_no_filters_keeps_every_sample": ("slow",),
    "tests/test_run_model_behaviour.py::test_rate_limits_are_retried_and_every_prompt_finishes": ("slow",),
    "tests/test_run_model_behaviour.py::test_reasoning_in_every_format_ends_up_in_think_blocks": ("slow",),
    "tests/test_run_model_behaviour.py::test_tool_calls_beyond_the_per_turn_cap_are_answered_but_not_run": ("slow",),
    # (keeps: the bodies byte for byte, the errors on each transport)
    "tests/test_model_transport.py::test_a_proxy_from_the_environment_carries_the_calls_on_each_transport": ("slow",),
    "tests/test_model_transport.py::test_a_run_sends_the_same_requests_and_writes_the_same_records_as_through_create":
        ("slow",),
    "tests/test_model_transport.py::test_dropped_connections_and_cut_responses_are_retried": ("slow",),
    "tests/test_model_layer.py::test_429s_and_500s_shrink_the_limit_and_every_prompt_still_finishes": ("slow",),
    "tests/test_model_layer.py::test_a_hung_endpoint_is_cut_by_the_prompt_timeout_and_saved_as_partial": ("slow",),
    "tests/test_model_layer.py::test_usage_cost_and_providers_are_summed_into_statistics": ("slow",),
    "tests/test_endpoint_numbers.py::test_an_endpoints_impossible_usage_is_not_reported_and_never_written": ("slow",),
    "tests/test_engine.py::test_a_slow_prompt_never_holds_up_the_others": ("slow",),
    "tests/test_limits.py::test_a_limit_that_fits_not_even_one_prompt_stops_before_any_model_call": ("slow",),
    "tests/test_first_run.py::test_skip_invalid_lists_the_lines_it_skipped": ("slow",),
    "tests/test_first_run.py::test_the_local_sandbox_says_once_that_it_ignores_images": ("slow",),
    "tests/test_hostile_input.py::test_a_line_over_the_size_limit_is_reported_without_being_read_whole": ("slow",),
    "tests/test_hostile_input.py::test_resume_over_records_holding_lone_surrogates_works": ("slow",),
    "tests/test_seed_compat.py::test_seed_style_boolean_values_are_accepted": ("slow",),
    "tests/test_seed_compat.py::test_statistics_and_checkpoint_carry_the_seed_fields": ("slow",),
    "tests/test_distributions.py::test_rng_is_stable_across_processes": ("slow",),
    "tests/test_packaging.py::test_every_distribution_is_found": ("slow",),
    "tests/test_plugins.py::test_importing_the_command_line_loads_no_plugin": ("slow",),
    "tests/test_tool_options.py::test_a_session_is_closed_when_the_prompt_deadline_cuts_a_tool_call": ("slow",),
    "tests/test_testing_server.py::test_an_answer_can_trickle_and_come_gzipped_with_padding": ("slow",),
    "tests/test_testing_server.py::test_command_line_serves_until_sigterm": ("slow",),
    "tests/test_scripts.py::test_test_sh_all_fails_when_either_run_fails": ("slow",),
    "tests/test_scripts.py::test_test_sh_keeps_what_it_started_when_asked_or_in_use": ("slow",),
    "tests/test_scripts.py::test_test_sh_stops_the_engine_and_container_it_started": ("slow",),
    "tests/test_view_report.py::test_view_on_a_full_disk_says_so_and_does_not_blame_the_port": ("slow",),
    "tests/test_view_report.py::test_view_serves_a_run_with_lines_that_are_no_record": ("slow",),
    # (keeps: test_datasets_loads_parquet_splits)
    "plugins/hermes_batch_parquet/tests/test_parquet.py::test_an_empty_export_is_a_valid_file": ("slow",),
    "plugins/hermes_batch_parquet/tests/test_parquet.py::test_an_old_record_with_a_lone_surrogate_is_repaired_as_the_run_does":
        ("slow",),
    "plugins/hermes_batch_parquet/tests/test_parquet.py::test_duckdb_queries_the_nested_columns": ("slow",),
    "plugins/hermes_batch_parquet/tests/test_parquet.py::test_parquet_options_and_their_errors": ("slow",),
    "plugins/hermes_batch_parquet/tests/test_parquet.py::test_several_runs_with_different_tools_export_and_load_as_one_parquet_dataset":
        ("slow",),
    "plugins/hermes_batch_filters/tests/test_filters.py::test_min_tool_calls": ("slow",),
    "plugins/hermes_batch_toolbox/tests/test_models.py::test_moa_passes_on_answers_never_reasoning": ("slow",),
    "plugins/hermes_batch_toolbox/tests/test_web.py::test_an_allowed_address_lets_through_that_address_and_port_only":
        ("slow",),
    "plugins/hermes_batch_toolbox/tests/test_web.py::test_extract_of_a_huge_page_reads_a_bounded_prefix": ("slow",),
    "plugins/hermes_batch_toolbox/tests/test_web.py::test_extract_reads_the_article_as_text_with_its_title": ("slow",),
    # perf: a bound on time or memory that tests running beside it could break
    "tests/test_dataset.py::test_large_file_streams_quickly_without_holding_it_in_memory": ("perf", "slow"),
    # a Ctrl-C timed against the answers in flight: on a busy machine some quick prompts' answers are still out
    "tests/test_accounting.py::test_ctrl_c_counts_every_prompt_it_saved_and_every_request_it_sent": ("perf",),
    "tests/test_local_sandbox.py::test_escaped_process_holding_the_pipe_does_not_hang_exec": ("perf",),
    "tests/test_model_transport.py::test_a_gzip_answer_is_capped_once_decompressed": ("perf",),
    "tests/test_model_transport.py::test_request_timeout_bounds_the_whole_answer_of_an_endpoint_that_trickles":
        ("perf", "slow"),
    "tests/test_run_folder_safety.py::test_ctrl_c_while_a_resume_reads_the_run_folder_is_heard_at_once": ("perf",),
    "tests/test_testing_server.py::test_latency_is_per_call_and_concurrent": ("perf",),
}


def _needs(item) -> set:
    needs = {NEEDS_OF_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in NEEDS_OF_FIXTURES}
    path = os.path.relpath(str(item.path), str(item.config.rootpath)).replace(os.sep, "/")
    name = getattr(item, "originalname", item.name)
    keys = [path, f"{path}::{name}"]
    if item.name != name:  # one parametrisation: file::name[id]
        keys.append(f"{path}::{item.name}")
    cls = getattr(item, "cls", None)
    if cls is not None:
        keys += [f"{path}::{cls.__name__}", f"{path}::{cls.__name__}::{name}"]
    for key in keys:
        needs.update(NEEDS_OF_TESTS.get(key, ()))
    return needs


def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = _needs(item)
        for need in sorted(needs):
            item.add_marker(need)
        if "ray" in needs:  # one Ray cluster for the session: its tests go to one xdist worker (--dist loadgroup)
            item.add_marker(pytest.mark.xdist_group("ray"))
