"""Batch prompts sharing most of their blocks with one being prefilled wait for its first
token: policy.prefix.follows and engine/prefix_leaders.py (on real vLLM: the prefix
bench, bench/prefix.py, and the e2e batch tests, whose items share prompts)."""

from __future__ import annotations

import asyncio

from engine.prefix_leaders import PrefixLeaders
from policy.prefix import block_hashes, follows

SYSTEM = list(range(1000, 1064))  # four 16-token blocks every prompt below shares


def prompt(own: int, extra_blocks: int = 0) -> tuple[int, ...]:
    return block_hashes(SYSTEM + [own] * (16 * extra_blocks + 5), 16)


def test_a_prompt_follows_the_deepest_block_in_prefill_only_where_it_is_most_of_its_own():
    leader = prompt(1)
    assert follows(prompt(2), set(leader)) == leader[3]  # 4 of its 4 full blocks are being computed
    assert follows(prompt(2, extra_blocks=4), set(leader)) == leader[3]  # 4 of 8: half
    assert follows(prompt(2, extra_blocks=5), set(leader)) is None  # 4 of 9: not worth the wait
    assert follows(prompt(2), set(leader[:1])) is None  # a shared opening block alone
    assert follows(prompt(2), set()) is None
    assert follows(block_hashes([7] * 10, 16), set(leader)) is None  # no full block: nothing to share


def test_a_prefix_prefilled_within_one_step_is_not_waited_for():
    leader = prompt(1)
    assert follows(prompt(2), set(leader), min_blocks=3) == leader[3]  # 4 blocks: more than a step's 3
    assert follows(prompt(2), set(leader), min_blocks=4) is None  # one step computes them: go at once


def test_a_prompt_unlike_any_in_prefill_follows_nothing():
    assert follows(block_hashes(list(range(64)), 16), set(prompt(1))) is None


async def test_followers_wait_for_the_leaders_first_token_and_then_go_together():
    leaders = PrefixLeaders(patience_s=5)
    went: list[int] = []

    async def follower(n: int) -> None:
        await leaders.wait(prompt(n))
        went.append(n)

    with leaders.lead(prompt(1)) as prefilled:
        waiting = [asyncio.create_task(follower(n)) for n in (2, 3, 4)]
        await asyncio.sleep(0.05)
        assert went == [] and leaders.followed == 3
        prefilled()  # its first token: the shared blocks are in vLLM's cache
        await asyncio.wait_for(asyncio.gather(*waiting), 1)
        assert sorted(went) == [2, 3, 4]
        await asyncio.wait_for(leaders.wait(prompt(5)), 0.1)  # prefilled: a newcomer goes at once


async def test_a_leader_that_ends_or_fails_releases_its_followers():
    leaders = PrefixLeaders(patience_s=5)
    try:
        with leaders.lead(prompt(1)):
            waiting = asyncio.create_task(leaders.wait(prompt(2)))
            await asyncio.sleep(0.01)
            raise RuntimeError("aborted")
    except RuntimeError:
        pass
    await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(leaders.wait(prompt(3)), 0.1)  # nothing left registered


async def test_patience_bounds_the_wait_and_zero_turns_waiting_off():
    leaders = PrefixLeaders(patience_s=0.05)
    with leaders.lead(prompt(1)):
        await asyncio.wait_for(leaders.wait(prompt(2)), 1)  # gave up after 0.05 s
    off = PrefixLeaders(patience_s=0)
    with off.lead(prompt(1)):
        await asyncio.wait_for(off.wait(prompt(2)), 0.01)
    assert off.followed == 0


async def test_a_second_leader_keeps_the_blocks_the_first_holds():
    leaders = PrefixLeaders(patience_s=5)
    with leaders.lead(prompt(1)) as first:
        with leaders.lead(prompt(2, extra_blocks=4)):  # shares the first's 4 blocks, adds 4
            waiting = asyncio.create_task(leaders.wait(prompt(3)))  # its 4 blocks: the first's
            await asyncio.sleep(0.02)
            assert not waiting.done()
            first()
            await asyncio.wait_for(waiting, 1)
