"""How a step's sequences are split over ranks and into micro-batches (pure)."""

from echo2cli.learner.batching import balance, micro_batches


def test_ranks_get_every_sequence_once_with_token_counts_close():
    lengths = [900, 100, 120, 400, 380, 60, 50, 700]
    split = balance(lengths, 2)
    assert sorted(i for r in split for i in r) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in r) for r in split]
    assert abs(loads[0] - loads[1]) <= max(lengths) and sum(loads) == sum(lengths)
    assert balance(lengths, 1) == [list(range(len(lengths)))]
    assert balance([5], 3) == [[0], [], []]  # fewer sequences than ranks: some ranks get none


def test_micro_batches_keep_the_padded_size_within_the_token_budget():
    lengths = [1000, 30, 40, 500, 480, 20]
    chunks = micro_batches(range(6), lengths, max_tokens=1000, max_seqs=8)
    assert sorted(i for c in chunks for i in c) == list(range(6))
    for c in chunks:
        assert len(c) == 1 or len(c) * max(lengths[i] for i in c) <= 1000
    assert [0] in chunks  # as long as the budget: alone
    assert micro_batches([0, 1, 2], [10, 10, 10], max_tokens=0, max_seqs=2) == [[0, 1], [2]]  # no budget: counts only
    assert micro_batches([0], [5000], max_tokens=100, max_seqs=4) == [[0]]  # longer than the budget: still trained


def test_micro_batches_keep_a_group_together_where_the_limits_allow():
    # two groups of 4 (ids 0 and 1) interleaved, lengths mixed: by length alone they would be cut across groups
    groups = [0, 1, 0, 1, 0, 1, 0, 1]
    lengths = [50, 52, 48, 60, 51, 49, 47, 53]
    chunks = micro_batches(range(8), lengths, max_tokens=0, max_seqs=4, groups=groups)
    assert [sorted({groups[i] for i in c}) for c in chunks] == [[1], [0]]  # group 1 holds the longest sequence
    assert sorted(i for c in chunks for i in c) == list(range(8))
    # the token budget still holds: 3 x 60 > 150 cuts group 1 in two
    chunks = micro_batches(range(8), lengths, max_tokens=150, max_seqs=4, groups=groups)
    for c in chunks:
        assert len(c) * max(lengths[i] for i in c) <= 150


def test_a_packed_budget_counts_the_tokens_of_the_packed_row_a_shared_prompt_once():
    lengths = [10, 10, 10, 10]  # two groups of two: prompts of 6 tokens, completions of 4
    groups, prompts = [0, 0, 1, 1], [6, 6, 6, 6]
    assert micro_batches(range(4), lengths, 14, 8, groups, packed=True, prompt_lengths=prompts) == [[0, 1], [2, 3]]
    assert micro_batches(range(4), lengths, 14, 8, groups, packed=True) == [[0], [1], [2], [3]]  # no prompt known
    assert micro_batches(range(4), [9, 3, 3, 3], 12, 8, packed=True) == [[0, 1], [2, 3]]  # no padding counted
    assert micro_batches(range(4), [9, 3, 3, 3], 12, 8) == [[0], [1, 2, 3]]  # padded: 2 x 9 > 12


def test_mini_batches_are_runs_of_whole_groups_as_even_as_they_allow():
    from echo2cli.learner.batching import mini_batches

    assert mini_batches(4, 1) == [[0, 1, 2, 3]]
    assert mini_batches(4, 4) == [[0], [1], [2], [3]]
    assert mini_batches(5, 2) == [[0, 1, 2], [3, 4]]
    assert mini_batches(2, 4) == [[0], [1]]  # never an empty mini-batch (a batch short of groups)
