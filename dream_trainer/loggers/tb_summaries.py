"""TensorBoard `Summary` protos for what TensorBoardLogger writes besides scalars.

Built from tensorboard's proto modules only (`tensorboard.compat.proto`, the plugins' `*_pb2`):
`torch.utils.tensorboard.summary` would do the same, but importing it loads tensorboard's
TensorFlow stub, which a run that only logs scalars should not pay for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dream_trainer.utils.images import encode_png

_HPARAMS = "hparams"  # the hparams plugin's name and its tags, as tensorboard's hparams plugin reads them
_EXPERIMENT_TAG = "_hparams_/experiment"
_SESSION_START_TAG = "_hparams_/session_start_info"
_SESSION_END_TAG = "_hparams_/session_end_info"


def _plugin_value(tag: str, plugin: str, content: bytes, **fields: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=plugin, content=content))
    return Summary.Value(tag=tag, metadata=metadata, **fields)


def hparams_start(params: Mapping[str, int | float | str | bool]) -> Any:
    """The hparams plugin's experiment and session-start records: the HPARAMS tab lists the run with these."""
    from google.protobuf import struct_pb2
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for name, value in params.items():
        if isinstance(value, bool):  # before int: a bool is an int
            start.hparams[name].CopyFrom(struct_pb2.Value(bool_value=value))
            kind = api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, (int, float)):
            start.hparams[name].CopyFrom(struct_pb2.Value(number_value=float(value)))
            kind = api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].CopyFrom(struct_pb2.Value(string_value=str(value)))
            kind = api_pb2.DATA_TYPE_STRING
        infos.append(api_pb2.HParamInfo(name=name, type=kind))
    experiment = plugin_data_pb2.HParamsPluginData(version=0, experiment=api_pb2.Experiment(hparam_infos=infos))
    session = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=start)
    return Summary(
        value=[
            _plugin_value(_EXPERIMENT_TAG, _HPARAMS, experiment.SerializeToString()),
            _plugin_value(_SESSION_START_TAG, _HPARAMS, session.SerializeToString()),
        ]
    )


def hparams_end(status: str) -> Any:
    """The hparams plugin's session-end record: the run's status ("success" or a failure)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    code = api_pb2.STATUS_SUCCESS if status == "success" else api_pb2.STATUS_FAILURE
    end = plugin_data_pb2.HParamsPluginData(version=0, session_end_info=plugin_data_pb2.SessionEndInfo(status=code))
    return Summary(value=[_plugin_value(_SESSION_END_TAG, _HPARAMS, end.SerializeToString())])


def text(tag: str, body: str) -> Any:
    """A text-plugin record (markdown) under `<tag>/text_summary`, as TensorBoard's TEXT tab shows it."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    tensor = TensorProto(
        dtype="DT_STRING", string_val=[body.encode()], tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
    )
    content = TextPluginData(version=0).SerializeToString()
    return Summary(value=[_plugin_value(f"{tag}/text_summary", "text", content, tensor=tensor)])


def images(tag: str, batch: torch.Tensor) -> Any:
    """PNG image records for uint8 `(N, H, W, C)` images: `tag` for one image, `tag/i` for several."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = []
    for i, img in enumerate(batch):
        h, w, c = img.shape
        name = tag if len(batch) == 1 else f"{tag}/{i}"
        image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=encode_png(img))
        values.append(Summary.Value(tag=name, image=image))
    return Summary(value=values)


def histogram(tag: str, values: torch.Tensor, bins: int = 30) -> Any:
    """A histogram record of `values` (any shape, finite) with `bins` equal-width buckets."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

    flat = values.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        raise ValueError(f"log_histogram({tag!r}): the tensor is empty")
    counts, edges = torch.histogram(flat, bins=bins)
    proto = HistogramProto(
        min=flat.min().item(),
        max=flat.max().item(),
        num=flat.numel(),
        sum=flat.sum().item(),
        sum_squares=flat.square().sum().item(),
        bucket_limit=edges[1:].tolist(),
        bucket=counts.tolist(),
    )
    return Summary(value=[Summary.Value(tag=tag, histo=proto)])
