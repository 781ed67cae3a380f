"""Test setup: two logical CPU devices, so MirroredStrategy has 2 replicas.

Logical devices must be configured before TensorFlow initialises its
runtime, which is why this happens at import time of the test session.
"""

import functools
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

if os.environ["KERAS_BACKEND"] == "tensorflow":
    import tensorflow as tf

    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )
# Under JAX or PyTorch (`.ci/backends`) only tests/backends runs: it imports
# no TensorFlow.


@functools.cache
def mirrored_strategy():
    """The one MirroredStrategy (2 logical CPUs) of the test session.

    On CPUs it all-reduces with collective ops, and every instance starts its
    collective keys at the same group key: a second instance running other
    collectives in the same process collides with the first ("Shape mismatch
    in the collective instance"), a TensorFlow limitation. Tests share this
    one; a test needing other cross-device ops must avoid collectives.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def micro_steps(trainer, dataset, count):
    """Feeds the first `count` batches of `dataset` to `trainer.micro_batch_step`,
    one global micro-batch per call (a fresh iterator: the trainer's data
    counters, not the iterator, carry the position across a restore)."""
    iterator = iter(trainer.distribute(dataset))
    for _ in range(count):
        trainer.micro_batch_step(iterator)


# Scripts run as subprocesses, not test modules: doctest collection would
# import them and run them (the argument parser of _train_job.py; the whole
# allocator measurement of _held_memory.py, in the wrong process).
collect_ignore = ["_train_job.py", "_held_memory.py"]

# For a test whose `fit` calls end inside a window on purpose, in a loop or a
# case where not every call does: the library's "training ended inside a
# window" warning is expected there. (A single such call is wrapped in
# `pytest.warns(UserWarning, match="... of its ... micro-batches")` instead.)
ends_mid_window = pytest.mark.filterwarnings("ignore:.*training ended inside a window:UserWarning")


# -- tiers ---------------------------------------------------------------------
# `python3 -m pytest -q` runs the fast tier: every library behaviour, numpy
# reference, ported case and in-process bad-input table. The slow tier
# (`python3 -m pytest -q -m slow`, run by .ci/run after the fast one) holds
# what runs whole studies, drills, benchmarks or other processes. A test sits
# in exactly one tier; a new slow test goes in SLOW_FILES, SLOW_TESTS or
# SLOW_CASES.

# Whole files: studies, drills, benchmark smoke runs, multi-process runs.
SLOW_FILES = {
    "test_bench.py",  # bench smoke runs and the bench script
    "test_cross_backend.py",  # a process per other backend (.ci/backends runs it too)
    "test_data_parallel.py",  # two JAX devices in a subprocess (.ci/backends)
    "test_per_device.py",  # two JAX devices in subprocesses, HLO dumps (.ci/backends)
    "test_backend_bench_smoke.py",  # the backend bench in a subprocess (.ci/backends)
    "test_jax_processes.py",  # two JAX processes on 127.0.0.1, a SIGKILL (.ci/backends)
    "test_torch_processes.py",  # two PyTorch gloo processes on 127.0.0.1 (.ci/backends)
    "test_held_memory.py",  # a subprocess per measurement
    "test_install_without_tensorflow.py",  # a JAX child without TensorFlow (about 9 s)
    "test_invariance.py",  # the invariance study end to end
    "test_kill_drill.py",  # the SIGKILL drill
    "test_multiworker.py",  # two worker processes on 127.0.0.1
    "test_schedules_study.py",  # the schedules study end to end
}
# Single tests that start the scripts in a subprocess or kill one.
SLOW_TESTS = {
    "test_bad_input.py": {
        "test_script_subprocess_error_is_one_line",
        "test_study_script_refuses_an_unknown_variant_in_one_line",
        "test_script_subprocess_names_a_corrupt_config_json",
        "test_script_corrected_command_runs_in_the_refused_folder",
    },
    "test_data.py": {"test_mnist1d_prepared_by_two_processes_at_once"},
    "test_schedule_controls.py": {  # a smoke study of the controls (about a minute)
        "test_smoke_study_writes_its_files_and_reruns_identically",
        "test_smoke_arms_count_updates_gradients_and_kappa",
    },
    "test_schedule_decay_mnist1d.py": {  # a smoke study of the MNIST-1D task (about 10 s)
        "test_smoke_study_trains_the_cnn_on_a_validation_split_deterministically",
    },
    "test_experiment.py": {
        "test_script_unknown_flag_lists_valid_flags",
        "test_script_missing_dataset_fails_fast",
        "test_script_trains_and_reports",
        "test_script_runs_two_local_workers",
    },
    "test_run_folder.py": {
        "test_new_run_killed_early_is_taken_by_either_command",
        "test_resume_of_an_unstarted_run_takes_its_edited_config",
    },
    "test_training.py": {
        "test_killed_run_resumes_to_the_same_weights",
        "test_kill_inside_a_write_keeps_the_previous_file",
        "test_kill_between_writes_and_a_failed_write",
    },
}
# Tests of library behaviour that train a larger model, several replicas or
# several whole runs (over ~3 s each on an idle 2-core machine); a name with
# its parameters (`name[params]`) moves that case alone. Each keeps a faster
# sibling in the fast tier (a smaller model, one device, or graph mode).
SLOW_CASES = {
    "test_data.py": {
        "test_validation_split_is_carved_from_train",
    },
    "test_experiment.py": {
        "test_every_saved_config_runs_in_smoke_size",
        "test_first_run_on_a_fresh_data_dir_equals_the_second",
        "test_resume_continues_exactly",
    },
    "test_fit_and_saving.py": {
        "test_mirrored_fit_equals_one_device[gradient_accumulation_clipped]",
        "test_mirrored_fit_equals_one_device[invariant_adam]",
    },
    # Two or three GPT-2 fits each (30-60 s each on a loaded 2-core machine);
    # the one-fit Adam-variant tests stay in the fast tier.
    "test_keras_hub.py": {
        "test_gradient_accumulation_equals_the_big_batch",
        "test_token_weighted_windows_equal_the_big_batch",
        "test_restart_mid_window_continues_the_run_exactly",
        "test_full_fine_tune_resumes_with_backup_and_restore",
    },
    "test_language_model.py": {
        "test_fit_mixed_float16_with_global_clipnorm",
        "test_fit_two_replicas_equals_the_big_batch",
    },
    "test_remat.py": {
        "test_a_model_not_rematerialized_trains_bit_identically",
        "test_custom_loop_same_weights[lm]",
        "test_fit_same_weights[lm-full]",
        "test_fit_same_weights[lm-larger_than]",
        "test_fit_same_weights_under_xla",
        "test_fit_under_mirrored_same_weights",
        "test_gradients_are_those_of_the_model[xla]",
        "test_loop_checkpoint_is_that_of_the_run_without_remat",
        "test_memory_probe_measures_less_with_remat",
        "test_mirrored_same_weights",
        "test_mixed_precision_recomputes_in_float16",
        "test_run_records_remat_and_peak_memory",
        "test_saved_model_is_the_same_model",
        "test_saved_model_loads",
    },
    "test_run_folder.py": {
        "test_a_config_json_cut_by_an_older_version_is_restarted",
    },
    "test_schedules.py": {
        "test_custom_loop_resumes_mid_window_across_a_switch",
        "test_mirrored_equals_one_device_with_schedule_doubled[invariant_adam]",
        "test_mirrored_equals_one_device_with_schedule_doubled[invariant_adam_fixed_beta_1_ema]",
        "test_save_and_load_mid_window_across_a_switch[invariant_adam_fixed_beta_1_ema]",
        "test_save_and_load_mid_window_across_a_switch[update_accumulation_adam]",
    },
    "test_sparse.py": {
        "test_fit_on_a_transformer_matches_dense_gradients[graph-GradientAccumulation]",
        "test_fit_on_a_transformer_matches_dense_gradients[xla-InvariantAdam]",
    },
    "test_training.py": {
        "test_mid_window_checkpoint_restores_accumulators[ga_adam]",
        "test_mid_window_checkpoint_restores_accumulators[update]",
    },
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        file = item.path.name
        name = getattr(item, "originalname", item.name)
        cases = SLOW_CASES.get(file, ())
        if (
            file in SLOW_FILES
            or name in SLOW_TESTS.get(file, ())
            or name in cases
            or item.name in cases
        ):
            item.add_marker(pytest.mark.slow)
