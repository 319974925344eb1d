"""`esper evaluate`: the learned policy and the controls on fresh hosts; table, CSV and JSON
agree."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from esper import heap
from esper.cli import main
from esper.contracts.evaluation import DEFAULT_CONTROLLERS as CONTROLLERS
from esper.evaluation import evaluate as evaluate_module
from esper.evaluation.evaluate import evaluate, evaluation_config
from esper.mdp.env import MorphogeneticVecEnv
from esper.report.statistics import paired_difference
from esper.report.tradeoff import TRADEOFF_FILE
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.heuristic import HeuristicController
from esper.tamiyo.policy import PolicyNetwork
from tests.test_cli import TINY_CONFIG

EPISODES = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run")
    config = root / "tiny.yaml"
    config.write_text(TINY_CONFIG.replace("max_epochs: 2", "max_epochs: 1"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["esper"])
        assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(root)]) == 0
    return root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_table_csv_and_json_agree_and_cover_every_default_controller(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval"
    assert (
        main(
            ["evaluate", "--ckpt", str(checkpoint), "--episodes", str(EPISODES), "--out", str(out)]
        )
        == 0
    )
    captured = capsys.readouterr()
    printed = captured.out
    progress = [line.split()[0] for line in captured.err.splitlines() if "episode(s) in" in line]
    assert sorted(progress) == sorted(CONTROLLERS)  # one line per controller, as each finishes
    assert progress[0] == "learned"  # the grower first: the static controls copy it
    table = {
        line.split()[0]: line.split()
        for line in printed.splitlines()
        if line.split() and line.split()[0] in CONTROLLERS
    }
    with (out / "evaluation.csv").open() as f:
        rows = {row["controller"]: row for row in csv.DictReader(f)}
    payload = json.loads((out / "evaluation.json").read_text())
    assert (out / TRADEOFF_FILE).is_file()  # accuracy against compute, beside the table
    by_json = {row["controller"]: row for row in payload["rows"]}
    assert list(table) == list(rows) == list(by_json) == list(CONTROLLERS)
    groups = payload["episode_group"]
    assert groups == [0, 0, 1]  # two envs side by side: episodes 0 and 1 share a group
    for name in CONTROLLERS:
        acc = float(rows[name]["final_test_acc_mean"])
        assert acc == pytest.approx(by_json[name]["final_test_acc_mean"])
        assert float(table[name][1]) == pytest.approx(acc, abs=1e-4)  # as printed, first
        assert int(rows[name]["episodes"]) == EPISODES
        for key in ("final_test_acc", "final_val_acc", "params_final", "train_flops"):
            assert len(payload[key][name]) == EPISODES
        assert float(rows[name]["params_final_mean"]) > 0
        assert float(rows[name]["train_flops_mean"]) > 0
    assert float(rows["no_growth"]["params_added_mean"]) == 0.0
    assert float(rows["no_growth"]["seeds_germinated_mean"]) == 0.0
    for name in set(CONTROLLERS) - {"no_growth"}:  # each paired with no growth, as printed
        est = paired_difference(
            payload["final_test_acc"][name], payload["final_test_acc"]["no_growth"], groups
        )
        assert float(rows[name]["vs_no_growth_mean"]) == pytest.approx(est.mean)
        assert by_json[name]["vs_no_growth_se"] == pytest.approx(est.se)
        assert f"{est.mean * 100:+.2f} ± {est.se * 100:.2f} pts" in " ".join(table[name])


@pytest.mark.slow
def test_every_controller_starts_from_the_same_hosts_and_growth_is_legal(checkpoint: Path) -> None:
    result = evaluate(checkpoint, episodes=2, controllers=("random", "no_growth"))
    first = {name: groups[0][0].val_acc.tolist() for name, groups in result.steps.items()}
    assert first["random"] == first["no_growth"]  # same initial hosts, same first epoch
    for groups in result.steps.values():
        assert not any(s.illegal.any() for steps in groups for s in steps)


@pytest.mark.slow
def test_a_sampled_policy_repeats_its_episodes_and_keeps_them_paired(checkpoint: Path) -> None:
    runs = [
        evaluate(checkpoint, episodes=2, controllers=("learned", "no_growth"), sample=True)
        for _ in range(2)
    ]
    first, again = ({r.controller: r for r in run.results} for run in runs)
    assert first["learned"].final_val_acc == again["learned"].final_val_acc
    assert first["learned"].seeds_germinated_mean == again["learned"].seeds_germinated_mean
    hosts = {name: groups[0][0].val_acc.tolist() for name, groups in runs[0].steps.items()}
    assert hosts["learned"] == hosts["no_growth"]  # the same initial hosts as the reference


@pytest.mark.slow
def test_the_heuristic_acts_on_raw_observations_and_the_policy_on_normalised_ones(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw: list[torch.Tensor] = []
    seen: dict[str, list[torch.Tensor]] = {"heuristic": [], "learned": []}
    observe = MorphogeneticVecEnv.observe

    def recording_observe(env: MorphogeneticVecEnv) -> tuple[torch.Tensor, ActionMasks]:
        obs, masks = observe(env)
        raw.append(obs.clone())
        return obs, masks

    def recording(cls: type, name: str) -> None:
        act = cls.act
        monkeypatch.setattr(
            cls, "act", lambda self, obs, *a, **k: seen[name].append(obs) or act(self, obs, *a, **k)
        )

    monkeypatch.setattr(MorphogeneticVecEnv, "observe", recording_observe)
    recording(HeuristicController, "heuristic")
    recording(PolicyNetwork, "learned")
    for name in ("heuristic", "learned"):
        raw.clear()
        evaluate(checkpoint, episodes=1, controllers=(name,))
        acted_on = raw[:-1]  # the last observation only bootstraps the critic
        assert len(seen[name]) == len(acted_on) > 0
        same = [torch.equal(a, b) for a, b in zip(seen[name], acted_on, strict=True)]
        # The checkpoint's normaliser is fitted: the policy never sees a raw observation.
        assert all(same) if name == "heuristic" else not any(same)


def test_the_learned_policy_acts_at_its_own_thread_count_as_in_training(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts: list[int] = []
    act = PolicyNetwork.act

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts.append(torch.get_num_threads())
        return act(self, *args, **kwargs)

    monkeypatch.setattr(PolicyNetwork, "act", counting)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        evaluate(checkpoint, episodes=1, controllers=("learned",))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert counts and set(counts) == {1}  # PolicyConfig.cpu_threads' default


def test_bad_arguments_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="episodes"):
        evaluate(checkpoint, episodes=0)
    with pytest.raises(ValueError, match="unknown controllers"):
        evaluate(checkpoint, controllers=("oracle",))
    with pytest.raises(ValueError, match="neither range"):
        evaluate(checkpoint, episodes=1, seed=-1, controllers=("no_growth",))


@pytest.mark.slow
def test_evaluate_and_report_write_pictures_of_the_stated_size(
    checkpoint: Path, tmp_path: Path
) -> None:
    from matplotlib.image import imread

    from esper.report.curves import LEARNING_CURVE_SIZE
    from esper.report.timeline import TIMELINE_SIZE

    out = tmp_path / "eval"
    assert main(["evaluate", "--ckpt", str(checkpoint), "--episodes", "2", "--out", str(out)]) == 0
    pictures = sorted((out / "timelines").glob("*.png"))
    assert len(pictures) == 2 * len(CONTROLLERS)
    for picture in pictures:
        image = imread(picture)
        assert image.shape[:2] == (TIMELINE_SIZE[1], TIMELINE_SIZE[0])
        assert image.std() > 0  # not a blank canvas

    run_dir = checkpoint.parent.parent
    assert main(["report", str(run_dir)]) == 0
    curve = next(run_dir.rglob("learning_curve.png"))
    image = imread(curve)
    assert image.shape[:2] == (LEARNING_CURVE_SIZE[1], LEARNING_CURVE_SIZE[0])
    assert image.std() > 0


@pytest.mark.parametrize(
    ("n_envs", "pair_size", "paired", "per_rank", "expected"),
    [
        (8, 4, True, None, 4),
        (4, 4, True, None, 4),
        (2, 4, True, None, 2),
        (8, None, True, None, 8),
        (8, 4, False, None, 8),
        (4, 4, True, 2, 2),  # 4 envs over 2 DDP ranks: each host saw half of every batch
        (8, None, False, 4, 4),
        (16, 4, True, 8, 4),
    ],
)
def test_evaluation_groups_are_as_large_as_a_training_hosts_data_share(
    n_envs: int, pair_size: int | None, paired: bool, per_rank: int | None, expected: int
) -> None:
    """A training host saw 1/group of every batch on its rank; an evaluated host must see
    as much."""
    from esper.simic.module import PPOModule
    from esper.simic.ppo import PPOConfig

    module = PPOModule(
        n_envs=n_envs,
        ppo=PPOConfig(
            pair_size=pair_size,
            paired_envs=paired,
            critic_baseline=not paired,
            vf_coef=0.0 if paired else 0.5,
        ),
    )
    assert evaluation_config(module, per_rank).n_envs == expected


def test_a_checkpoint_records_its_envs_per_rank_and_a_damaged_record_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    from esper.callbacks.checkpoint import CheckpointError
    from esper.simic.checkpoint_contents import ENVS_PER_RANK_KEY

    saved = torch.load(checkpoint, weights_only=True)
    assert saved[ENVS_PER_RANK_KEY] == saved["hyper_parameters"]["n_envs"]  # one rank
    damaged = tmp_path / "damaged.ckpt"
    torch.save({**saved, ENVS_PER_RANK_KEY: 3}, damaged)
    with pytest.raises(CheckpointError, match=f"{ENVS_PER_RANK_KEY}=3.*damaged"):
        evaluate(damaged, episodes=1, controllers=("no_growth",))


@pytest.mark.parametrize(
    ("words", "named"),
    [
        (["--seed", "5000"], "--seed: evaluation seed 5000 is in neither range"),
        (["--controllers", "learned,oracle"], "--controllers/--grower: unknown controllers"),
        (["--controllers", "static_final,no_growth"], "add it to the controllers"),
        (["--episodes", "0"], "--episodes must be >= 1"),
        (["--device", "banana"], "--device: must name a device such as 'cpu' or 'cuda:0'"),
        (["--device", "cuda:99"], "--device: names cuda:99, which this machine cannot use"),
        (["--out", "FILE/evaluation"], "--out: cannot write the results in"),
    ],
)
def test_bad_evaluate_options_are_one_line_naming_the_option_before_any_work(
    words: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from esper.cli.bad_input import BAD_INPUT_STATUS

    missing = tmp_path / "never-read.ckpt"
    (tmp_path / "FILE").write_text("a file where --out wants a folder")
    words = [w.replace("FILE", str(tmp_path / "FILE")) for w in words]
    before = set(tmp_path.rglob("*"))
    assert main(["evaluate", "--ckpt", str(missing), *words]) == BAD_INPUT_STATUS
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert set(tmp_path.rglob("*")) == before


def test_ctrl_c_during_an_evaluation_is_one_line_saying_what_was_done_and_exits_130(
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was a KeyboardInterrupt traceback (from the worker threads' join)."""
    from esper.evaluation import comparison

    real_run = comparison.run_episodes
    calls: list[int] = []

    def interrupted_second(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)

    monkeypatch.setattr(comparison, "run_episodes", interrupted_second)
    words = ["--controllers", "no_growth,periodic", "--episodes", "1", "--out", str(tmp_path)]
    assert main(["evaluate", "--ckpt", str(checkpoint), *words]) == 130
    err = capsys.readouterr().err.rstrip().splitlines()
    assert err[0].startswith("  no_growth ") and len(err) == 2, err
    assert err[1].startswith("esper evaluate: interrupted with 1 of 2 controllers done"), err
    assert not list(tmp_path.iterdir())


def test_an_output_folder_that_can_be_written_is_left_as_it_was(tmp_path: Path) -> None:
    """The check made what did not exist, wrote in it, and took it all away again."""
    from esper.cli.bad_input import try_writing_in

    try_writing_in(tmp_path / "a" / "b" / "evaluation")
    assert not list(tmp_path.iterdir())


def test_the_episodes_run_with_freed_memory_kept_and_hand_it_back_after(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its hosts train as a fit's do (``esper.heap``), and nothing is kept once it ends."""
    for name in ("GLIBC_TUNABLES", *heap.MALLOC_ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    applied = heap.keep_freed_memory(heap.HeapRetention())  # False where not glibc
    heap.release_freed_memory(heap.HeapRetention())
    real_compare = evaluate_module.compare
    holders: list[int] = []

    def watching(*args, **kwargs):  # type: ignore[no-untyped-def]
        holders.append(len(heap._holders))
        return real_compare(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "compare", watching)
    evaluate(checkpoint, episodes=1, controllers=("no_growth",))
    assert holders == [1 if applied else 0]
    assert heap._holders == []
