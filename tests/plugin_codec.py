"""A third-party codec, registered by name in the codec registry tests."""

from deltasync.codec.raw import RawCodec


class PluginCodec(RawCodec):
    name = "raw-plugin"
