"""bench/cpu_profile.py: perf's report parsed, and samples sorted by process role and kind of work by name."""

from bench.cpu_profile import breakdown, kind_of, parse_report, role_of

REPORT = """\
# Samples: 1K of event 'cpu-clock:pppH'
#
    40.00%    400        0:swapper  [kernel.kallsyms]           [k] pv_native_safe_halt
    25.00%    250     4242:ray::TargetWor  specserve_ops-abc.so   [.] (anonymous namespace)::tile<8l, 3l>
    10.00%    100     4242:ray::TargetWor  specserve_ops-abc.so   [.] specserve::attend_rows
     5.00%     50     4242:ray::TargetWor  python3.11             [.] _PyEval_EvalFrameDefault
     6.00%     60     4300:VLLM::EngineCor  [unknown]              [.] 0x00007f3a12345678
     4.00%     40     4300:VLLM::EngineCor  libdnnl.so.3           [.] dnnl::impl::cpu::x64::brgemm_kernel
     7.00%     70     5000:python3         python3.11             [.] _PyEval_EvalFrameDefault
     3.00%     30     5100:haproxy         haproxy                [.] process_runnable_tasks
"""


def test_report_lines_are_parsed_with_their_pid_comm_dso_and_symbol():
    rows = parse_report(REPORT)
    assert len(rows) == 8
    assert rows[1] == (250, 4242, "ray::TargetWor", "specserve_ops-abc.so", "(anonymous namespace)::tile<8l, 3l>")
    assert rows[0][1] == 0


def test_roles_and_kinds_come_from_names():
    assert role_of("python3 | python -m vllm.benchmarks.serve ...") == "client"
    assert role_of("ray::TargetWork | ray::TargetWorkerCore.call") == "model worker"
    assert role_of("ray::ServeRepli | ray::ServeReplica:specserve:Router") == "scheduler"
    assert role_of("ray::ServeRepli | ray::ServeReplica:specserve:TargetServer") == "Serve's model replicas (leases)"
    assert role_of("VLLM::Worker | VLLM::Worker") == "model worker"
    assert role_of("VLLM::EngineCor | ") == "scheduler"
    assert role_of("haproxy | haproxy -f cfg") == "HTTP server / proxy"
    assert role_of("raylet | /x/raylet --node") == "Ray's daemons"
    assert role_of("bash | bash") == "other"
    assert kind_of("specserve_ops.so", "specserve::cache_attention") == "attention"
    assert kind_of("libdnnl.so.3", "brgemm_kernel") == "matrix products"
    assert kind_of("[unknown]", "0x7f") == "JIT code"
    assert kind_of("libgomp.so.1", "gomp_barrier_wait") == "threads waiting"
    assert kind_of("libc.so.6", "memcpy") == "other"


def test_the_breakdown_gives_shares_of_every_sample():
    names = {4242: "ray::TargetWor | ray::TargetWorker", 5000: "python3 | python -m vllm.benchmarks.serve"}
    got = breakdown(parse_report(REPORT), names)
    assert got["samples"] == 1000
    assert got["roles"] == {"idle": 40.0, "model worker": 40.0, "scheduler": 10.0, "client": 7.0,
                            "HTTP server / proxy": 3.0}
    assert got["kinds"]["model worker"] == {"matrix products": 25.0, "attention": 10.0, "Python": 5.0}
    assert got["kinds"]["scheduler"] == {"JIT code": 6.0, "matrix products": 4.0}
    assert list(got["top"]["model worker"])[0] == "matrix products: specserve_ops-abc.so (anonymous namespace)::tile<8l, 3l>"


def test_every_thread_is_named_by_its_process():
    import threading

    from bench.cpu_profile import processes, thread_names

    helper = threading.Thread(target=lambda: names.update(thread_names(processes())))
    names: dict = {}
    helper.start()
    helper.join()
    assert "pytest" in names[threading.get_native_id()] or "python" in names[threading.get_native_id()]


def test_cpu_seconds_by_role_count_from_start_or_zero():
    from bench.cpu_profile import seconds_by_role

    before = {1: ("ray::TargetWork | ray::TargetWorkerCore", 10.0), 2: ("haproxy | haproxy", 1.0)}
    last = {1: ("ray::TargetWork | ray::TargetWorkerCore", 14.5), 2: ("haproxy | haproxy", 1.0),
            3: ("python | python vllm_cli.py bench serve", 2.25)}  # started inside the block
    assert seconds_by_role(before, last) == {"model worker": 4.5, "client": 2.25}
