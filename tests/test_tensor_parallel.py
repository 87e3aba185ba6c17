

@pytest.mark.parametrize("kind,mode", [("rnn", "dspark"), ("zlab", "dflash")])
def test_other_drafters(tiny_target, tiny_drafters, kind, mode):
    """The RNN head (replicated) and a z-lab DFlash drafter (1+N block layout) on 2 ranks."""
    drafters = (tiny_target, tiny_drafters(kind, 4))
    ref = [o.token_ids for o in single(drafters, mode, "fixed").generate(PROMPTS, GREEDY, use_tqdm=False)]
    outs = parallel(kind, drafters, mode, "fixed").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
