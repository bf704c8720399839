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
#   ray        a local Ray cluster of two nodes
#   browser    Debian's Chromium (scripts/chromium.sh), through Playwright
#   slow       takes more than about 5 s on a busy 2-core machine (most start hermes-batch in child processes)
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

# Tests (a file, or file::name for every parametrisation of one test) -> what they need that no fixture says:
# the tests that drive Chromium without a fixture of it, long runs, and those that compare times.
NEEDS_OF_TESTS = {
    "plugins/hermes_batch_toolbox/tests/test_browser.py": ("browser",),
    "plugins/hermes_batch_toolbox/tests/test_end_to_end.py::test_thirty_prompts_with_every_toolset": ("browser",),
    "plugins/hermes_batch_toolbox/tests/test_open_files.py": ("browser", "slow"),
    "tests/test_view_guard.py::test_a_rebound_name_reads_nothing_in_chromium": ("browser",),
    # slow: runs of hermes-batch in child processes, worker processes, big files (more than ~5 s on a busy machine)
    "tests/test_record_schema.py": ("slow",),  # a run of 2,900 prompts, made once for the module
    "tests/test_process_executor.py": ("slow",),  # every test starts worker processes
    "tests/test_accounting.py::test_sigkill_then_resume_counts_every_request_the_endpoint_served": ("slow",),
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
    "plugins/hermes_batch_filters/tests/test_filters.py::test_planted_near_duplicates_are_found_and_nothing_else": ("slow",),
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
    for key in (path, f"{path}::{getattr(item, 'originalname', item.name)}"):
        needs.update(NEEDS_OF_TESTS.get(key, ()))
    return needs


def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = _needs(item)
        for need in sorted(needs):
            item.add_marker(need)
        if "ray" in needs:  # one Ray cluster for the session: its tests go to one xdist worker (--dist loadgroup)
            item.add_marker(pytest.mark.xdist_group("ray"))
