from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValueType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_TYPE_UNSPECIFIED: _ClassVar[ValueType]
    VALUE_TYPE_STRING: _ClassVar[ValueType]
    VALUE_TYPE_INT64: _ClassVar[ValueType]
    VALUE_TYPE_FLOAT64: _ClassVar[ValueType]
VALUE_TYPE_UNSPECIFIED: ValueType
VALUE_TYPE_STRING: ValueType
VALUE_TYPE_INT64: ValueType
VALUE_TYPE_FLOAT64: ValueType

class Column(_message.Message):
    __slots__ = ("name", "type", "values", "lengths")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: ValueType
    values: bytes
    lengths: bytes
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[ValueType, str]] = ..., values: _Optional[bytes] = ..., lengths: _Optional[bytes] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("num_candidates", "context", "candidates")
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    num_candidates: int
    context: _containers.RepeatedCompositeFieldContainer[Column]
    candidates: _containers.RepeatedCompositeFieldContainer[Column]
    def __init__(self, num_candidates: _Optional[int] = ..., context: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., candidates: _Optional[_Iterable[_Union[Column, _Mapping]]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("scores", "model")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    scores: bytes
    model: str
    def __init__(self, scores: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...
