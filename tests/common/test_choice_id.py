from llmserve.common.choice_id import names_request


def test_a_request_id_names_itself_and_its_numbered_choices() -> None:
    assert names_request("chatcmpl-ab", "chatcmpl-ab")
    assert names_request("chatcmpl-ab", "chatcmpl-ab-0")
    assert names_request("chatcmpl-ab", "chatcmpl-ab-12")


def test_other_ids_sharing_a_prefix_are_not_named() -> None:
    assert not names_request("chatcmpl-ab", "chatcmpl-abc")
    assert not names_request("chatcmpl-ab", "chatcmpl-ab-")
    assert not names_request("chatcmpl-ab", "chatcmpl-ab-x1")
    assert not names_request("chatcmpl-ab-1", "chatcmpl-ab")
    assert not names_request("r", "r-1-2")
