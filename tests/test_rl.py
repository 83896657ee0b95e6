"""scripts/chat_rl.py, the chat pipeline's RL stage: the tasks and their checkers (gpt/rl/tasks.py), the policy
gradient on sampled tokens only, and a run of the command from a tiny SFT model of the arithmetic
task (made once for the module): its metrics and checkpoints, kill -9 then init_from=auto, 2 gloo
ranks against one process, and its one-line errors."""

import json
import re
import shutil
import signal

import pytest
import torch
from conftest import CPU, TINY, chat, check_export, one_line_error, read_metrics, running
from processes import REPO, load_script, needs_gloo, run_python, run_script, signalled_run

from configurator import UserError
from gpt.rl import rollouts, tasks

# GSM8K's published format: the worked answer, with its calculator annotations, ends in '#### N'
GSM8K_LINES = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "A farm has 1,200 hens and buys 34 more. How many hens does it have?",
        "answer": "1,200 + 34 = <<1200+34=1234>>1,234\n#### 1,234",
    },
    {"question": "It is 5 degrees and drops 8. What is the temperature?", "answer": "5 - 8 = -3\n#### -3"},
]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_gsm8k_checker_is_the_number_after_the_hashes_commas_removed(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_LINES)
    task = tasks.load("gsm8k", train_file=path, test_file=path)
    assert [p.answer for p in task.test] == ["72", "1234", "-3"]
    assert task.test[0].solution == GSM8K_LINES[0]["answer"]
    natalia, hens, cold = task.test
    for problem, completion, reward in [
        (natalia, GSM8K_LINES[0]["answer"], 1.0),  # the reference itself
        (natalia, "so 72 in all\n#### 72", 1.0),
        (natalia, "72", 0.0),  # no '####': nanochat's checker finds no answer
        (natalia, "#### 73", 0.0),
        (natalia, "#### 72.0", 0.0),  # compared as text, as nanochat does
        (hens, "#### 1,234", 1.0),  # commas removed on both sides
        (hens, "#### 1234 hens", 1.0),
        (hens, "#### 12,34", 1.0),  # nanochat's rule: every comma goes
        (cold, "#### -3", 1.0),
        (cold, "#### 3", 0.0),
    ]:
        assert task.reward(problem, completion) == reward, (problem.answer, completion)
    assert [tasks.gsm8k_answer(r["answer"]) for r in GSM8K_LINES] == ["72", "1234", "-3"]


def test_own_jsonl_checks_exactly_or_as_numbers(tmp_path):
    mine = [{"prompt": "Capital of France?", "answer": "Paris"}, {"prompt": "2+2", "answer": 4}]
    path = write_jsonl(tmp_path / "mine.jsonl", mine)
    exact = tasks.load("jsonl", train_file=path, test_file=path, check="exact")
    assert [exact.reward(exact.test[0], c) for c in ("Paris", " Paris\n", "paris", "Paris.")] == [1, 1, 0, 0]
    numbers = [{"prompt": "2+2", "answer": "4"}, {"prompt": "big", "answer": "1,000"}]
    numbers = write_jsonl(tmp_path / "n.jsonl", numbers)
    numeric = tasks.load("jsonl", train_file=numbers, test_file=numbers, check="numeric")
    four, thousand = numeric.test
    assert [numeric.reward(four, c) for c in ("4", "it is 4.0", "3 then 4", "4 then 3", "four")] == [1, 1, 1, 0, 0]
    assert [numeric.reward(thousand, c) for c in ("1,000", "1000", "100")] == [1, 1, 0]


def test_arithmetic_is_seeded_checked_as_gsm8k_and_holds_out_its_test_numbers():
    task = tasks.load("arithmetic", seed=3, n_train=300, n_test=40)
    again = tasks.load("arithmetic", seed=3, n_train=300, n_test=40)
    assert task.train == again.train and task.test == again.test
    assert task.train != tasks.load("arithmetic", seed=4, n_train=300, n_test=40).train
    numbers = lambda p: tuple(int(x) for x in re.findall(r"\d+", p.solution)[:3])
    train, test = {numbers(p) for p in task.train}, {numbers(p) for p in task.test}
    assert not train & test and len(test) > 10
    for p in task.train + task.test:
        a, b, c = numbers(p)
        assert p.answer == str(a + b - c) and int(p.answer) >= 0 and f"{a}" in p.prompt
        assert task.reward(p, p.solution) == 1.0 and task.reward(p, f"#### {int(p.answer) + 1}") == 0.0


@pytest.mark.parametrize(
    "kind, lines, said",
    [
        ("gsm8k", [GSM8K_LINES[0], "{not json", GSM8K_LINES[1]], ":2: not JSON"),
        (
            "gsm8k",
            [GSM8K_LINES[0], GSM8K_LINES[1], {"question": "q", "answer": "no number"}],
            ":3: the answer has no '#### N'",
        ),
        ("gsm8k", [{"question": "q"}], ":1: no 'answer' text"),
        ("jsonl", [{"prompt": "p", "answer": "a"}, "[1, 2]"], ":2: not a JSON object"),
        ("jsonl", [{"prompt": "p", "answer": "a"}, "", {"answer": "b"}], ":3: no 'prompt' text"),
        ("numeric", [{"prompt": "p", "answer": "seven"}], ":1: the answer 'seven' is not a number"),
    ],
)
def test_a_bad_task_line_is_named_by_its_number(tmp_path, kind, lines, said):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    check = "numeric" if kind == "numeric" else "exact"
    with pytest.raises(UserError, match=re.escape(f"{path}{said}")):
        tasks.load("gsm8k" if kind == "gsm8k" else "jsonl", train_file=path, test_file=path, check=check)


# ---------------------------------------------------------------------------- the policy gradient


def test_the_loss_covers_the_sampled_tokens_only():
    """-sum(advantage * log p) over each sample's tokens up to its end token: positions past it get no
    gradient, and the loss is the reference's, computed token by token."""
    torch.manual_seed(0)
    G, L, V = 3, 5, 11
    logits = torch.randn(G, L, V, requires_grad=True)
    tokens = torch.randint(0, V, (G, L))
    lengths, advantages = [5, 2, 3], torch.tensor([0.5, -0.25, -0.25])
    mask = rollouts.sampled_mask(lengths, L, "cpu")
    loss = rollouts.policy_loss(logits, tokens, mask, advantages)
    logp = torch.log_softmax(logits.detach(), -1)
    reference = -sum(advantages[g] * logp[g, t, tokens[g, t]] for g in range(G) for t in range(lengths[g]))
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    loss.backward()
    for g in range(G):
        assert logits.grad[g, lengths[g] :].abs().sum() == 0 and logits.grad[g, : lengths[g]].abs().sum() > 0


def test_a_step_scores_the_positions_that_predict_sampled_tokens():
    """policy_step's forward reads the prompt and the samples; its loss is the reference's over the
    sampled tokens alone (up to each one's length), a mean over the step's sampled tokens."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    prompt, tokens = [3, 1, 4, 1, 5], torch.randint(0, 65, (2, 4))
    group = rollouts.Group(prompt, tokens, [4, 2], [1.0, 0.0], torch.tensor([0.5, -0.5]))
    full = torch.cat([torch.tensor([prompt] * 2), tokens], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(full[:, :-1], logits_at="all")[0], -1)
    P, weights = len(prompt), {0: (0.5, 4), 1: (-0.5, 2)}
    reference = -sum(a * logp[g, P - 1 + t, full[g, P + t]] for g, (a, n) in weights.items() for t in range(n)) / 6
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, norm = rollouts.policy_step(model, optimizer, scaler, [group], 0.0, 0.0, CPU, world_tokens=6)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5) and norm > 0


def test_pass_at_k_is_the_unbiased_estimate():
    assert rollouts.pass_at_k(8, 0, 1) == 0 and rollouts.pass_at_k(8, 8, 1) == 1
    assert rollouts.pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert rollouts.pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) / C(4,2) pairs miss it
    assert rollouts.pass_at_k(4, 3, 2) == 1


# ---------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tiny chat model (TINY's blocks, block_size 64) SFT'd on 2,000 arithmetic conversations for 60
    steps: it answers in the task's format, right a few times in ten, so groups have rewards to compare."""
    root = tmp_path_factory.mktemp("rl")
    data = root / "data"
    load_script("data/chat/arithmetic.py").main([f"--out_dir={data}", "--n=2000"])
    tokenizer = ["--input", f"{data}/text.txt", "--vocab_size=512", f"--out_dir={data}", "--val_chars=2000"]
    load_script("data/train_tokenizer.py").main(tokenizer)
    prepare = ["--input", f"{data}/train.jsonl", f"--tokenizer={data}/tokenizer.json", f"--out_dir={data}"]
    load_script("data/chat/prepare.py").main([*prepare, "--block_size=64"])
    keys = dict(TINY, block_size=64, dataset=data, out_dir=root / "sft", device="cpu", compile=False, batch_size=8)
    keys.update(gradient_accumulation_steps=1, learning_rate=1e-2, min_lr=1e-3, max_iters=60, lr_decay_iters=60)
    keys.update(warmup_iters=2, eval_interval=60, eval_iters=2, log_interval=20)
    del keys["vocab_size"]
    result = run_script("train.py", *[f"--{k}={v}" for k, v in keys.items()])
    assert result.returncode == 0, result.stderr
    return root


def rl_args(sft, out, **overrides):
    """scripts/chat_rl.py's flags for 4 steps of 2 problems x 4 samples from the sft model, pass@1..2 on 2 held-out
    problems at iters 0, 2 and 4 (a checkpoint at 2 and 4)."""
    keys = dict(start_from=sft / "sft", out_dir=out, device="cpu", max_iters=4, lr_decay_iters=4, eval_interval=2)
    keys.update(examples_per_step=2, samples=4, max_new_tokens=16, eval_examples=2, pass_k=2, learning_rate=3e-3)
    return [f"--{k}={v}" for k, v in {**keys, **overrides}.items()]


@pytest.fixture(scope="module")
def straight(sft):
    """The straight run, with init_from=auto (which starts a new run in an empty out_dir)."""
    out = sft / "straight"
    result = run_script("scripts/chat_rl.py", *rl_args(sft, out, init_from="auto"))
    assert result.returncode == 0, result.stderr
    (out / "stdout.txt").write_text(result.stdout)
    return out


def untimed_rl(out):
    """The run's records without their timings: two runs that sampled and stepped the same give equal lists."""
    timings = ("dt_ms", "tokens_per_s")
    return [json.dumps({k: v for k, v in r.items() if k not in timings}) for r in read_metrics(out)]


def test_a_run_logs_rewards_pass_at_k_and_writes_chat_checkpoints(straight):
    records = read_metrics(straight)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "pass@1" in r]
    assert [r["iter"] for r in steps] == [0, 1, 2, 3] and [r["iter"] for r in evals] == [0, 2, 4]
    for r in steps:
        assert 0 <= r["reward"] <= 1 and 1 <= r["sampled_length"] <= 16 and r["sampled_tokens"] >= 8
    assert any(r["reward"] not in (0, 1) for r in steps)  # some group had rewards to tell apart: a gradient
    assert all(0 <= r["pass@1"] <= r["pass@2"] <= 1 for r in evals)
    assert (straight / "ckpt.pt").exists()
    assert "init_from='auto': no checkpoint" in (straight / "stdout.txt").read_text()
    chat = [f"--out_dir={straight}", "--checkpoint=latest", "--prompt=Ava has 2 apples.", "--max_new_tokens=8"]
    reply = run_script("chat.py", *chat)
    assert reply.returncode == 0 and reply.stdout.strip(), reply.stderr


def test_eval_only_scores_pass_at_k_again_with_the_same_seeds(straight, tmp_path):
    """pass@k as an evaluation: --eval_only=True on the run's newest checkpoint samples the held-out
    problems with the seeds of every eval, so it scores what the run's last eval scored."""
    out = shutil.copytree(straight, tmp_path / "copy")
    keys = dict(out_dir=out, init_from="resume", eval_only=True, device="cpu", eval_examples=2, pass_k=2)
    result = run_script("scripts/chat_rl.py", *[f"--{k}={v}" for k, v in keys.items()], "--max_new_tokens=16")
    assert result.returncode == 0, result.stderr
    assert "step 4: 2 held-out problems: pass@1" in result.stdout
    passes = lambda r: {k: v for k, v in r.items() if k.startswith("pass@")}
    scores = lambda run: [passes(r) for r in read_metrics(run) if "pass@1" in r]
    assert scores(out) == scores(straight) + scores(straight)[-1:]
    assert not (out / "ckpt_0000004.pt").exists()  # an evaluation writes no checkpoint
    assert (out / "ckpt.pt").stat().st_mtime == (straight / "ckpt.pt").stat().st_mtime
    flags = [f"--out_dir={straight}", "--task=arithmetic", "--checkpoint=latest", "--examples=2", "--pass_k=2"]
    scored = run_script("scripts/chat_eval.py", *flags, "--max_new_tokens=16")  # scripts/chat_eval.py's pass@k
    found = lambda text: re.findall(r"held-out problems: (pass@1 [\d.]+, pass@2 [\d.]+)", text)
    assert found(scored.stdout) == found(result.stdout), scored.stdout + scored.stderr


def test_gsm8k_files_train_a_few_steps_and_score_as_the_same_problems_generated(sft, straight, tmp_path):
    """--task=gsm8k on files in GSM8K's format (calculator annotations, '#### N') holding the arithmetic
    task's problems: it trains, and its held-out problems score at iter 0 what the generated ones did."""
    generated = tasks.load("arithmetic", n_train=36, n_test=12)
    as_gsm8k = lambda problems: [
        {"question": p.prompt, "answer": p.solution.replace(" = ", f" = <<{p.solution.split(' =')[0]}={p.answer}>>")}
        for p in problems
    ]
    train = write_jsonl(tmp_path / "train.jsonl", as_gsm8k(generated.train))
    test = write_jsonl(tmp_path / "test.jsonl", as_gsm8k(generated.test))
    assert "<<" in test.read_text() and "#### " in test.read_text()
    out = tmp_path / "gsm8k"
    args = rl_args(sft, out, task="gsm8k", train_file=train, test_file=test, max_iters=2, lr_decay_iters=2)
    result = run_script("scripts/chat_rl.py", *args)
    assert result.returncode == 0, result.stderr
    assert "rl: task gsm8k (36 train, 12 test problems)" in result.stdout
    records = read_metrics(out)
    assert [r["iter"] for r in records if "loss" in r] == [0, 1] and (out / "ckpt.pt").exists()
    evals = [r for r in records if "pass@1" in r]
    assert [r["iter"] for r in evals] == [0, 2]
    assert evals[0] == next(r for r in read_metrics(straight) if "pass@1" in r)


def test_the_rl_model_serves_and_exports_replying_as_chat_py(straight, tmp_path):
    """An RL'd checkpoint is a chat model like any: serve.py's replies to the openai client and the greedy
    replies of hf.py's export under transformers are chat.py's at temperature 0."""
    import openai

    out = shutil.copytree(straight, tmp_path / "out")  # a copy to export into
    asked = [[{"role": "user", "content": p.prompt}] for p in tasks.load("arithmetic", seed=1337).test[:3]]
    with running(f"--out_dir={out}") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for messages in asked:
            served = client.chat.completions.create(model="out", messages=messages, temperature=0, max_tokens=16)
            ours = chat(out, f"--prompt={messages[0]['content']}", "--temperature=0", "--max_new_tokens=16")
            assert ours.stdout == served.choices[0].message.content + "\n"
    check_export(out, 16, conversations=asked)


@pytest.mark.process
def test_kill_9_then_init_from_auto_resumes_exactly(sft, straight, tmp_path):
    """scripts/chat_rl.py killed with SIGKILL as it starts iter 3 (after iter 2's checkpoint), then the same command
    again: it resumes at iter 2 and logs what the straight run logged, rewards and losses alike."""
    out = tmp_path / "out"
    args = rl_args(sft, out, init_from="auto")
    killed = signalled_run(tmp_path, "scripts/chat_rl.py", "SIGKILL", 3, args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = run_script("scripts/chat_rl.py", *args)
    assert again.returncode == 0, again.stderr
    assert f"init_from='auto': resuming the run in out_dir={out} (iter 2" in again.stdout
    assert untimed_rl(out) == untimed_rl(straight)


@pytest.mark.process
@needs_gloo
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_gloo_ranks_equal_one_process(sft, straight, tmp_path, parallelism):
    """torchrun, 2 CPU ranks (DDP, FSDP2), each sampling its problem with the same seeds: the straight run's
    rewards, lengths and pass@k; its losses and gradient norms but for the order of the float sums."""
    out = tmp_path / "two"
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "scripts/chat_rl.py"]
    args = rl_args(sft, out, init_from="auto", parallelism=parallelism)
    result = run_python([*cmd, *args], env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    two, one = read_metrics(out), read_metrics(straight)
    exact = ("iter", "reward", "sampled_tokens", "pass@1", "pass@2")
    assert [{k: r.get(k) for k in exact} for r in two] == [{k: r.get(k) for k in exact} for r in one]
    close = lambda records: [r[k] for r in records for k in ("loss", "grad_norm") if k in r]
    assert close(two) == pytest.approx(close(one), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    "case, said",
    [
        ("samples=1", ["samples=1: a group of 1 sample", "every advantage is 0"]),
        ("plain run", ["was not trained on conversations"]),
        ("bad line", ["bad.jsonl:2: not JSON"]),
        ("gsm8k, no files, no network", ["cannot read openai/gsm8k (train) from the Hugging Face hub", "--train_file"]),
    ],
)
def test_bad_input_is_one_line(sft, tiny_run, tmp_path, case, said):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+2", "answer": "4"}\n{oops\n')
    overrides = {
        "samples=1": dict(samples=1),
        "plain run": dict(start_from=tiny_run),
        "bad line": dict(task="jsonl", train_file=bad, test_file=bad),
        "gsm8k, no files, no network": dict(task="gsm8k"),
    }[case]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # read as the hub's library is imported: a process
    args = rl_args(sft, tmp_path / "out", **overrides)
    one_line_error(run_script("scripts/chat_rl.py", *args, env=offline, isolated="network" in case), *said)
