from llmserve.protos import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("num_in_flight", "num_aborted", "elapsed_s", "done")
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    num_aborted: int
    elapsed_s: float
    done: bool
    def __init__(self, num_in_flight: _Optional[int] = ..., num_aborted: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    class Entry(_message.Message):
        __slots__ = ("replica", "request")
        REPLICA_FIELD_NUMBER: _ClassVar[int]
        REQUEST_FIELD_NUMBER: _ClassVar[int]
        replica: str
        request: _scheduler_pb2.RequestState
        def __init__(self, replica: _Optional[str] = ..., request: _Optional[_Union[_scheduler_pb2.RequestState, _Mapping]] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ListRequestsResponse.Entry]
    def __init__(self, requests: _Optional[_Iterable[_Union[ListRequestsResponse.Entry, _Mapping]]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class GetCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaCapacity(_message.Message):
    __slots__ = ("replica", "ready", "draining", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "steps_per_s", "tenants")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    ready: bool
    draining: bool
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    steps_per_s: float
    tenants: _containers.RepeatedCompositeFieldContainer[_scheduler_pb2.TenantStats]
    def __init__(self, replica: _Optional[str] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., tenants: _Optional[_Iterable[_Union[_scheduler_pb2.TenantStats, _Mapping]]] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("replicas", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "steps_per_s")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaCapacity]
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    steps_per_s: float
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaCapacity, _Mapping]]] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., steps_per_s: _Optional[float] = ...) -> None: ...

class TenantConfig(_message.Message):
    __slots__ = ("tenant", "weight", "tokens_per_minute", "max_concurrent_requests", "num_in_flight")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    tokens_per_minute: int
    max_concurrent_requests: int
    num_in_flight: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., tokens_per_minute: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., num_in_flight: _Optional[int] = ...) -> None: ...

class SetTenantWeightRequest(_message.Message):
    __slots__ = ("tenant", "weight")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("tenant", "tokens_per_minute", "max_concurrent_requests")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tokens_per_minute: int
    max_concurrent_requests: int
    def __init__(self, tenant: _Optional[str] = ..., tokens_per_minute: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantConfig]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantConfig, _Mapping]]] = ...) -> None: ...

class GetHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComponentHealth(_message.Message):
    __slots__ = ("component", "healthy", "detail")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    component: str
    healthy: bool
    detail: str
    def __init__(self, component: _Optional[str] = ..., healthy: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class Health(_message.Message):
    __slots__ = ("components",)
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    components: _containers.RepeatedCompositeFieldContainer[ComponentHealth]
    def __init__(self, components: _Optional[_Iterable[_Union[ComponentHealth, _Mapping]]] = ...) -> None: ...
