"""The exit gate: no FFI handler waits for the GIL while the interpreter shuts down.

XLA runs a jitted program asynchronously, on its own threads, after the Python call that
dispatched it has returned; fastbwd's handler is Python (a ``ctypes`` callback), so each call
takes the GIL. When a program ends while such a computation is still queued or running, the
handler's thread asks for the GIL during interpreter finalisation, where CPython never gives it
back (3.11 ends the thread inside XLA's pool, later versions block it). The main thread,
meanwhile, destroys JAX's client, whose thread pool then waits forever for that thread: the
process never exits (docs/design.md, "The exit gate").

So XLA never calls the Python handler directly. It calls a gate: a few machine instructions,
built with llvmlite when a target is registered, that

1. count the call in flight (an atomic add), then read the ``closing`` flag;
2. open: call the Python handler, then uncount the call;
3. closing: uncount and return an XLA error ("the interpreter is exiting") without touching
   Python.

An ``atexit`` hook, registered after JAX's own (so it runs before JAX's clean-up), waits for
the CPU arrays the program still holds, closes the gate and waits, with the GIL released, until
no call is in flight. Either a call counted itself before the flag was set, and the hook waits
for it, or it reads the flag and never enters Python: both sides use sequentially consistent
atomics. Everything after the hook (JAX's clean-up, the user's earlier atexit handlers,
finalisation) runs as usual; a fastbwd call still queued then fails with that error instead of
hanging the process. The gates, their state and the handlers are never freed, because XLA may
call a gate until the very end of the process.
"""

import atexit
import ctypes
import os
import time

import llvmlite.binding as llvm

_EXECUTE_STAGE = 3
_INTERNAL_ERROR = 13
_MESSAGE = b"fastbwd.jax: the Python interpreter is exiting; this fastbwd call was not run"

# The shared state: word 0 counts the calls in flight, word 1 is the closing flag.
_STATE_IR = """
@fastbwd_gate_state = global [2 x i64] zeroinitializer, align 64

define i64 @fastbwd_gate_close() {
  %closing = getelementptr [2 x i64], ptr @fastbwd_gate_state, i64 0, i64 1
  store atomic i64 1, ptr %closing seq_cst, align 8
  %in_flight = load atomic i64, ptr @fastbwd_gate_state seq_cst, align 8
  ret i64 %in_flight
}
"""

# Gates are built GATES_PER_BATCH at a time, in one LLVM module (a build costs milliseconds; the
# bridge registers 7 targets): gate k calls the handler whose address is in slot k of its batch.
GATES_PER_BATCH = 8

_BATCH_IR = """
@message = private unnamed_addr constant [{message_size} x i8] c"{message}\\00"
@fastbwd_gate_slots_{batch} = global [{gates} x ptr] zeroinitializer, align 8
"""

_GATE_IR = """
define ptr @fastbwd_gate_{batch}_{index}(ptr %frame) {{
entry:
  %in_flight = inttoptr i64 {state} to ptr
  %closing = getelementptr i64, ptr %in_flight, i64 1
  %counted = atomicrmw add ptr %in_flight, i64 1 seq_cst
  %flag = load atomic i64, ptr %closing seq_cst, align 8
  %is_closing = icmp ne i64 %flag, 0
  br i1 %is_closing, label %refuse, label %open

open:
  %slot = getelementptr [{gates} x ptr], ptr @fastbwd_gate_slots_{batch}, i64 0, i64 {index}
  %handler = load atomic ptr, ptr %slot acquire, align 8
  %result = call ptr %handler(ptr %frame)
  %done = atomicrmw sub ptr %in_flight, i64 1 seq_cst
  ret ptr %result

refuse:
  %refused = atomicrmw sub ptr %in_flight, i64 1 seq_cst
  %stage_address = getelementptr i8, ptr %frame, i64 {stage_offset}
  %stage = load i32, ptr %stage_address, align 4
  %is_execute = icmp eq i32 %stage, {execute_stage}
  br i1 %is_execute, label %fail, label %nothing

nothing:
  ret ptr null

fail:
  %api_address = getelementptr i8, ptr %frame, i64 {api_offset}
  %api = load ptr, ptr %api_address, align 8
  %create_address = getelementptr i8, ptr %api, i64 {error_create_offset}
  %create = load ptr, ptr %create_address, align 8
  %args = alloca [4 x i64], align 8
  store i64 32, ptr %args, align 8
  %extension = getelementptr i64, ptr %args, i64 1
  store ptr null, ptr %extension, align 8
  %message_slot = getelementptr i64, ptr %args, i64 2
  store ptr @message, ptr %message_slot, align 8
  %errc = getelementptr i64, ptr %args, i64 3
  store i64 {error_code}, ptr %errc, align 8
  %error = call ptr %create(ptr %args)
  ret ptr %error
}}
"""

_engine = None
_state = None  # ctypes view of the two state words
_close = None
_batches = []  # the gates' modules (the engine owns their code)
_free = []  # (slots array, batch, index) of the gates built and not yet given a handler


def _immortal(obj):
    """Keep ``obj`` alive through interpreter finalisation, which clears module globals: a
    reference that is never given back (XLA may reach it until the process ends)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


def _start():
    global _engine, _state, _close
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    # a few instructions per gate need no optimisation, and a batch builds faster without it
    machine = llvm.Target.from_default_triple().create_target_machine(opt=0)
    _engine = _immortal(llvm.create_mcjit_compiler(llvm.parse_assembly(_STATE_IR), machine))
    _engine.finalize_object()
    _state = (ctypes.c_int64 * 2).from_address(_engine.get_global_value_address("fastbwd_gate_state"))
    _close = ctypes.CFUNCTYPE(ctypes.c_int64)(_engine.get_function_address("fastbwd_gate_close"))
    atexit.register(_drain)
    os.register_at_fork(after_in_child=_reopen)


def _build_batch(frame_offsets, error_create_offset):
    batch = len(_batches)
    stage_offset, api_offset = frame_offsets
    text = _BATCH_IR.format(
        message=_MESSAGE.decode(), message_size=len(_MESSAGE) + 1, gates=GATES_PER_BATCH, batch=batch
    )
    text += "".join(
        _GATE_IR.format(
            batch=batch,
            index=index,
            gates=GATES_PER_BATCH,
            state=ctypes.addressof(_state),
            stage_offset=stage_offset,
            api_offset=api_offset,
            error_create_offset=error_create_offset,
            execute_stage=_EXECUTE_STAGE,
            error_code=_INTERNAL_ERROR,
        )
        for index in range(GATES_PER_BATCH)
    )
    module = llvm.parse_assembly(text)
    module.verify()
    _engine.add_module(module)
    _engine.finalize_object()
    address = _engine.get_global_value_address(f"fastbwd_gate_slots_{batch}")
    slots = (ctypes.c_void_p * GATES_PER_BATCH).from_address(address)
    _batches.append(module)
    _free.extend((slots, batch, index) for index in reversed(range(GATES_PER_BATCH)))


def gate(handler, frame_offsets, error_create_offset):
    """The address of a gate in front of ``handler`` (a ``ctypes`` callback).

    ``frame_offsets`` are the byte offsets of ``stage`` and ``api`` in ``XLA_FFI_CallFrame``;
    ``error_create_offset`` that of ``XLA_FFI_Error_Create`` in ``XLA_FFI_Api``. Not thread-safe:
    the caller registers targets under its lock.
    """
    if _engine is None:
        _start()
    if not _free:
        _build_batch(frame_offsets, error_create_offset)
    slots, batch, index = _free.pop()
    slots[index] = ctypes.cast(_immortal(handler), ctypes.c_void_p).value
    return _engine.get_function_address(f"fastbwd_gate_{batch}_{index}")


def in_flight():
    """How many fastbwd FFI calls are inside the gate now (for tests)."""
    return 0 if _state is None else _state[0]


def _wait_for_held_results():
    """Let the computations behind the CPU arrays the program still holds finish, as they would
    have without the gate (an earlier-registered atexit handler of the user may read them)."""
    import jax

    try:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return  # nothing was ever dispatched (and no backend is started at exit)
    except (ImportError, AttributeError):  # a JAX without this check: the gate alone still holds
        return
    for array in jax.live_arrays("cpu"):
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - a failed computation was the program's to see
            pass


def _drain():
    try:
        _wait_for_held_results()
    finally:
        # Close, then wait with the GIL released (time.sleep) for the calls already inside.
        while _close() > 0:
            time.sleep(0.001)


def _reopen():
    """A child of ``fork`` starts with no calls in flight (the threads that made them are gone)."""
    _state[0] = 0
    _state[1] = 0
