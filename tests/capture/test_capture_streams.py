"""Stream ids: every form of one stream gets one id; default-stream sentinels are per device."""
from sanitizer.capture.streams import StreamIds


class FakeTorchStream:
    """Only the two attributes torch.cuda.Stream exposes that the table reads."""
    def __init__(self, handle, device_index):
        self.cuda_stream = handle
        self.device_index = device_index


def test_default_sentinels_are_the_device_stream():
    ids = StreamIds()
    assert ids.of_handle(0, 0) == "cuda:0"
    assert ids.of_handle(1, 1) == "cuda:1"
    assert ids.of_handle(2, 3) == "cuda:3"
    assert ids.known() == {}


def test_raw_handle_and_torch_stream_agree():
    ids = StreamIds()
    a = ids.of_handle(0x7F00AA, 0)
    b = ids.of_handle(0x7F00BB, 0)
    c = ids.of_handle(0x7F00CC, 1)
    assert (a, b, c) == ("cuda:0:s1", "cuda:0:s2", "cuda:1:s1")
    assert ids.of_torch(FakeTorchStream(0x7F00BB, 0)) == b
    assert ids.of_handle(0x7F00AA) == a          # the handle is the key, whatever device is passed
    assert ids.known() == {0x7F00AA: a, 0x7F00BB: b, 0x7F00CC: c}
