import pytest

from limiter.errors import InvalidName
from limiter.keys import PoolKeys, check_name
from limiter.scripts import lifecycle_keys


def test_every_key_of_a_pool_shares_its_hash_tag():
    keys = PoolKeys("llama-70b")
    names = [*lifecycle_keys(keys), keys.leader, keys.fence, keys.decisions, keys.request("abc"),
             keys.queue("P0", "acme"), keys.backlog("P0"), keys.vtime("P0"), keys.class_bucket("P0"),
             keys.tenant_bucket("acme"), keys.reply("fe-1"), keys.worker("w1"), keys.tokens("abc")]
    assert all(n.startswith("qos:{llama-70b}:") for n in names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("bad", ["", "a{b}", "a:b", "a b", "a*", "x" * 65, "ü", None, 5, "a\nb"])
def test_names_that_could_inject_keys_are_rejected(bad):
    with pytest.raises(InvalidName):
        check_name("tenant", bad)
    with pytest.raises(InvalidName):
        PoolKeys(bad)


def test_valid_names_pass():
    for ok in ["P0", "acme-corp", "tenant_1.prod", "x" * 64]:
        assert check_name("tenant", ok) == ok
