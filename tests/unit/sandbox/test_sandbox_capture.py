from services.sandbox.isolation.process import Capture


def test_short_output_is_kept_whole():
    capture = Capture(10)
    for chunk in (b"abc", b"def", b"ghij"):
        capture.feed(chunk)
    assert (capture.text(), capture.truncated) == ("abcdefghij", False)


def test_long_output_keeps_head_and_tail():
    capture = Capture(10)
    for i in range(100):
        capture.feed(bytes([48 + i % 10]) * 7)
    text = capture.text()
    assert capture.truncated and capture.total == 700
    assert text.startswith("00000") and text.endswith("99999")
    assert "[... 690 bytes of output omitted ...]" in text


def test_head_only_capture():
    capture = Capture(6, keep_tail=False)
    capture.feed(b"line1\nline2\nline3\n")
    assert capture.text() == "line1\n\n[... 12 bytes of output omitted ...]\n"
