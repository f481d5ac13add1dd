"""The sweep service's vocabulary, defined once: its MLflow tags, Optuna user attributes, stage names, the
recommended press file's name and the baselines a sweep enqueues.

NOTE: this module imports nothing, so every layer of the service (``workers``, ``tracking``, ``sweeps``) can name
these without importing another layer's code; the library (``grkv_core``) never names them.
"""

# The service's MLflow tags, which double as Optuna user attributes where both record the same fact.
SWEEP_TAG = "grkv.sweep_id"
ROLE_TAG = "grkv.role"  # "sweep" on the parent run, "trial" on each child
TRIAL_TAG = "grkv.trial_number"
PARENT_TAG = "mlflow.parentRunId"
BASELINE_TAG = "grkv.baseline"
STATUS_TAG = "grkv.status"
WORKER_PID_TAG = "grkv.worker_pid"
RECOVERED_TAG = "grkv.recovered"
BEST_TRIALS_TAG = "grkv.best_trials"
METHOD_ATTR = "grkv.method"
RUN_ID_ATTR = "grkv.run_id"
REQUEUE_OF_ATTR = "grkv.requeue_of"  # on a re-enqueued copy: the number of the trial it replaces
# On a proposal whose press equals one already evaluated (or being evaluated) in its study: that trial's number. Such
# a proposal is not evaluated: told as failed (so a sampler never counts one configuration twice), no MLflow run,
# not counted against the budget.
REUSES_ATTR = "grkv.reuses"
# Which stage of a sweep a child run belongs to: screening (losses and answer metrics, no decoding), full scoring
# on the tuning samples, or the held-out test stage; a test-stage run names what it confirms (a trial number or a
# baseline name) in TEST_OF_TAG.
STAGE_TAG = "grkv.stage"
SCREEN_STAGE = "screen"
FULL_STAGE = "full"
TEST_STAGE = "test"
STAGES = (SCREEN_STAGE, FULL_STAGE, TEST_STAGE)
TEST_OF_TAG = "grkv.test_of"
# The recommended press file (``grkv export``): written beside a sweep's state and logged to its parent run.
PRESS_ARTIFACT = "press.yaml"
# Optuna user attribute (and MLflow tag) of a full trial enqueued from screening: the screening trial's number.
PROMOTED_FROM_TAG = "grkv.promoted_from"
# Optuna user attribute of a ``one_at_a_time`` design's row: its index (so a resumed sweep enqueues no row twice).
DESIGN_ROW_ATTR = "grkv.design_row"
# NOTE: a trial's MLflow run logs the press that ran under the options' own names (``lambda_k``,
# ``press.window_size``) and the sampler's raw proposals under this prefix (``optuna.lambda_k_is_zero``).
SAMPLER_PREFIX = "optuna."
# Baseline trials a sweep enqueues first (the paper's Alg. 1, the base press alone, GRKVPress's defaults), and the
# suffix of the switch that proposes an exact zero for a log-uniform float (the paper's lambda = 0 ablation).
PAPER_DEFAULT = "paper_default"
EVICTION_ONLY = "eviction_only"
LIBRARY_DEFAULT = "library_default"
BASELINES = (PAPER_DEFAULT, EVICTION_ONLY, LIBRARY_DEFAULT)
ZERO_SUFFIX = "_is_zero"
# What sets a trial's budget when a sweep searches it: the compression ratio, or a bounded cache's sizes
# (``grkv_core.stream_options.DecodingOptions``); never a merger option.
BOUNDED_SIZES = ("target_size", "compression_interval")
BUDGET_PARAMS = ("compression_ratio", *BOUNDED_SIZES)
# The folder of a sweep's state directory where the workers keep their running trials' per-sample checkpoints.
CHECKPOINT_FOLDER = "checkpoints"
