//! The attach plan: which probes serve a recording, decided before anything
//! is loaded.
//!
//! In: what the user asked for ([`Request`]: the target, the sampling rate
//! and gate, `--probes`) and what the host offers ([`Host`]: the kernel's
//! BTF layouts, read beforehand, and its CPU counts). Out: an
//! [`AttachPlan`]: the scheduler mode and the [`ProbeSet`] the summary will
//! show (with why any part fell back), the value of every BPF global, the
//! map sizes, the programs to load and what to attach, in order.
//!
//! Pure: no file, no syscall, no aya. `kernel::probe` reads the host, then
//! loads the object from the plan and attaches what it lists; so every
//! fallback decision is tested here without a kernel.
use crate::kernel::btf::{KernelLayouts, SwitchLayout, ThrottleLayout};
use crate::model::{ProbeSet, SchedulerProbes, WaitProbes};

/// What the user asked for (`--probes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ProbeChoice {
    /// Uprobes on the watched processes' wait functions; for the scheduler
    /// and the sampling, per-thread perf events on the recorded process's
    /// threads (the daemon: on each loop thread it elects); each falls back
    /// where it cannot serve.
    #[default]
    Auto,
    /// The raw scheduler tracepoints even for one process (every context
    /// switch and wakeup on the host runs a program while attached), and
    /// CPU-clock sampling on every CPU.
    RawTracepoints,
    /// The classic tracepoints for everything (every process on the host
    /// pays for its syscalls and context switches while attached).
    Tracepoints,
}

/// What is to be watched, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The process watched (0: every process, the daemon).
    pub tgid: u32,
    /// `--frequency`: the sampling events' rate.
    pub sample_hz: u64,
    /// The sampling gate (0 = every sample, every busy period).
    pub sample_after_ns: u64,
    pub choice: ProbeChoice,
    /// The processes under `tgid` too, and those started later (not
    /// `--no-subprocesses`); ignored for the daemon (`tgid` 0).
    pub subprocesses: bool,
}

/// What the host offers, read before planning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub layouts: KernelLayouts,
    /// CPUs this process may run on (sizes the ring buffer).
    pub cpus: u64,
    /// CPUs that may ever come online (sizes the per-CPU scratch).
    pub possible_cpus: u32,
}

/// The BPF object's load-time knobs (`profiler-ebpf`'s globals), typed;
/// [`Globals::each`] is the one place their names are spelled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Globals {
    pub target_tgid: u32,
    pub sample_after_ns: u64,
    /// `task_struct.pid` for the raw tracepoints (0: none attached).
    pub task_pid_offset: u32,
    /// 1: the per-thread `context-switches` events serve the scheduler.
    pub thread_switches: u32,
    pub throttle_model: u32,
    pub task_throttled_offset: u32,
    /// Read by both the throttling and the per-thread switch readers.
    pub task_cfs_rq_offset: u32,
    pub cfs_rq_throttle_count_offset: u32,
    pub cfs_rq_self_time_offset: u32,
    pub task_state_offset: u32,
    pub task_last_arrival_offset: u32,
    pub cfs_rq_rq_offset: u32,
    pub rq_clock_offset: u32,
    pub rq_curr_offset: u32,
    pub task_comm_offset: u32,
    pub task_run_delay_offset: u32,
}

/// A global's value, as wide as the object declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalValue {
    U32(u32),
    U64(u64),
}

impl Globals {
    /// Every global by its name in the object, with its value.
    pub fn each(&self) -> [(&'static str, GlobalValue); 16] {
        use GlobalValue::{U32, U64};
        [
            ("TARGET_TGID", U32(self.target_tgid)),
            ("SAMPLE_AFTER_NS", U64(self.sample_after_ns)),
            ("TASK_PID_OFFSET", U32(self.task_pid_offset)),
            ("THROTTLE_MODEL", U32(self.throttle_model)),
            ("TASK_THROTTLED_OFFSET", U32(self.task_throttled_offset)),
            ("TASK_CFS_RQ_OFFSET", U32(self.task_cfs_rq_offset)),
            ("THREAD_SWITCHES", U32(self.thread_switches)),
            ("TASK_STATE_OFFSET", U32(self.task_state_offset)),
            (
                "TASK_LAST_ARRIVAL_OFFSET",
                U32(self.task_last_arrival_offset),
            ),
            ("CFS_RQ_RQ_OFFSET", U32(self.cfs_rq_rq_offset)),
            ("RQ_CLOCK_OFFSET", U32(self.rq_clock_offset)),
            ("RQ_CURR_OFFSET", U32(self.rq_curr_offset)),
            ("TASK_COMM_OFFSET", U32(self.task_comm_offset)),
            (
                "CFS_RQ_THROTTLE_COUNT_OFFSET",
                U32(self.cfs_rq_throttle_count_offset),
            ),
            ("CFS_RQ_SELF_TIME_OFFSET", U32(self.cfs_rq_self_time_offset)),
            ("TASK_RUN_DELAY_OFFSET", U32(self.task_run_delay_offset)),
        ]
    }
}

/// The sizes of the maps sized at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// `EVENTS`, the ring buffer, in bytes ([`ring_bytes`]).
    pub events: u32,
    /// `STACK_SCRATCH`: two build slots per CPU that may come online
    /// (stack.rs).
    pub stack_scratch: u32,
}

/// A program's type in the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgramKind {
    UProbe,
    PerfEvent,
    RawTracePoint,
}

/// A program loaded before anything attaches (the classic tracepoint
/// programs are loaded as they are first attached: the waits' may never be).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    pub program: &'static str,
    pub kind: ProgramKind,
}

/// One thing attached at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// The wait syscalls' classic tracepoints, host-wide.
    WaitTracepoints,
    /// `context-switches` and `cpu-clock` events on every thread of the
    /// process, inherited by the threads it starts.
    ThreadEvents { tgid: u32 },
    RawTracepoint {
        program: &'static str,
        tracepoint: &'static str,
    },
    /// The classic `sched:*` tracepoints.
    SchedTracepoints,
    /// `cpu-clock` sampling of every process on each online CPU.
    SampleEveryCpu { hz: u64 },
}

/// Everything [`crate::kernel::probe::Probes::attach`] does, decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachPlan {
    pub request: Request,
    /// The probes that will serve, and why any part fell back.
    pub probes: ProbeSet,
    pub globals: Globals,
    pub maps: MapSizes,
    /// `WAIT_TRACEPOINTS` starts at 1: the syscall tracepoints serve every
    /// wait, the wait uprobes stand down.
    pub wait_tracepoints: bool,
    /// In load order.
    pub load: Vec<Load>,
    /// In attach order.
    pub attach: Vec<Attach>,
}

/// Uprobes loaded at start, attached as runtimes and wait functions are
/// found.
const UPROBES: [&str; 4] = [
    "sp_park_enter",
    "sp_park_exit",
    "sp_uwait_enter",
    "sp_uwait_exit",
];

/// A process tree's new processes (`record` without `--no-subprocesses`).
const FORK_PROGRAM: &str = "sp_raw_fork";

/// The raw tracepoints' programs, exit first: with the per-thread switch
/// events only the exits are needed.
const RAW_TRACEPOINTS: [(&str, &str); 3] = [
    ("sp_raw_exit", "sched_process_exit"),
    ("sp_raw_sched_wakeup", "sched_wakeup"),
    ("sp_raw_sched_switch", "sched_switch"),
];

impl AttachPlan {
    pub fn new(request: Request, host: &Host) -> AttachPlan {
        let Request {
            tgid,
            sample_hz,
            sample_after_ns,
            choice,
            subprocesses,
        } = request;
        let k = &host.layouts;
        let mut notes = Vec::new();
        // A process tree: new processes are seen at their fork, by a raw
        // tracepoint reading the child's ids (whatever serves the rest).
        let forks = match (&k.raw, tgid != 0 && subprocesses) {
            (_, false) => None,
            (Ok(layout), true) => Some(layout.task_pid_offset),
            (Err(why), true) => {
                notes.push(format!(
                    "processes started under the target after attach are not watched (those \
                     under it at attach are), because {why}"
                ));
                None
            }
        };
        let raw = match choice {
            ProbeChoice::Tracepoints => {
                notes.push("classic tracepoints, as asked (--probes tracepoints)".to_string());
                None
            }
            ProbeChoice::Auto | ProbeChoice::RawTracepoints => match &k.raw {
                Ok(layout) => Some(*layout),
                Err(why) => {
                    notes.push(format!(
                        "scheduler: classic tracepoints, because {why}: every context switch \
                         on the host builds a trace record while attached"
                    ));
                    None
                }
            },
        };
        // Only the watched threads' own switches: the recorded process's
        // threads, or each loop thread the daemon elects.
        let switches: Option<SwitchLayout> = match (raw, choice) {
            (None, _) | (_, ProbeChoice::RawTracepoints) => None,
            _ => match k
                .switches
                .clone()
                .and_then(|l| k.run_delay.clone().map(|_| l))
            {
                Ok(l) => Some(l),
                Err(why) => {
                    notes.push(format!(
                        "scheduler: raw tracepoints, because {why}: every context switch and \
                         wakeup on the host runs a program while attached"
                    ));
                    None
                }
            },
        };
        if choice == ProbeChoice::RawTracepoints && raw.is_some() {
            notes.push(
                "scheduler: raw tracepoints, as asked (--probes raw-tracepoints): every context \
                 switch and wakeup on the host runs a program while attached"
                    .into(),
            );
        }
        // CPU throttling is told apart by task fields, whatever probes run.
        let throttle = k.throttle.clone().unwrap_or_else(|why| {
            notes.push(format!(
                "CPU throttling (cgroup CPU quota) is not told apart from run-queue \
                 waits, because {why}"
            ));
            ThrottleLayout::default()
        });
        let run_delay = k.run_delay.clone().unwrap_or_else(|why| {
            notes.push(format!(
                "a loop thread's wait for a CPU after its wakeup is not measured, because {why}"
            ));
            0
        });
        let scheduler = match (raw, switches) {
            (Some(_), Some(_)) => SchedulerProbes::ThreadEvents,
            (Some(_), None) => SchedulerProbes::RawTracepoints,
            (None, _) => SchedulerProbes::Tracepoints,
        };
        let wait_tracepoints = choice == ProbeChoice::Tracepoints;
        let sw = switches.unwrap_or_default();
        let globals = Globals {
            target_tgid: tgid,
            sample_after_ns,
            task_pid_offset: raw.map(|l| l.task_pid_offset).or(forks).unwrap_or(0),
            thread_switches: switches.is_some() as u32,
            throttle_model: throttle.model,
            task_throttled_offset: throttle.task_throttled,
            task_cfs_rq_offset: throttle.task_cfs_rq.max(sw.task_cfs_rq),
            cfs_rq_throttle_count_offset: throttle.cfs_rq_throttle_count,
            cfs_rq_self_time_offset: throttle.cfs_rq_self_time,
            task_state_offset: sw.task_state,
            task_last_arrival_offset: sw.task_last_arrival,
            cfs_rq_rq_offset: sw.cfs_rq_rq,
            rq_clock_offset: sw.rq_clock,
            rq_curr_offset: sw.rq_curr,
            task_comm_offset: sw.task_comm,
            task_run_delay_offset: run_delay,
        };
        let (load, attach) = steps(request, scheduler, forks.is_some());
        AttachPlan {
            request,
            probes: ProbeSet {
                scheduler,
                waits: if wait_tracepoints {
                    WaitProbes::Tracepoints
                } else {
                    WaitProbes::Uprobes
                },
                notes,
            },
            globals,
            maps: MapSizes {
                events: ring_bytes(sample_hz, host.cpus),
                stack_scratch: 2 * host.possible_cpus,
            },
            wait_tracepoints,
            load,
            attach,
        }
    }
}

/// The programs to load and what to attach for `scheduler`.
fn steps(request: Request, scheduler: SchedulerProbes, forks: bool) -> (Vec<Load>, Vec<Attach>) {
    let load_as = |kind| move |program| Load { program, kind };
    let mut load: Vec<Load> = UPROBES.map(load_as(ProgramKind::UProbe)).into();
    load.push(load_as(ProgramKind::PerfEvent)("sp_sample"));
    let mut attach = Vec::new();
    // First: a process started while the rest attaches is not missed.
    if forks {
        load.push(load_as(ProgramKind::RawTracePoint)(FORK_PROGRAM));
        attach.push(Attach::RawTracepoint {
            program: FORK_PROGRAM,
            tracepoint: "sched_process_fork",
        });
    }
    if request.choice == ProbeChoice::Tracepoints {
        attach.push(Attach::WaitTracepoints);
    }
    let raw: &[(&str, &str)] = match scheduler {
        SchedulerProbes::ThreadEvents => {
            load.push(load_as(ProgramKind::PerfEvent)("sp_thread_switch"));
            // The daemon opens them on each loop thread it elects.
            if request.tgid != 0 {
                attach.push(Attach::ThreadEvents { tgid: request.tgid });
            }
            &RAW_TRACEPOINTS[..1]
        }
        SchedulerProbes::RawTracepoints => &RAW_TRACEPOINTS,
        SchedulerProbes::Tracepoints | SchedulerProbes::Unrecorded => {
            attach.push(Attach::SchedTracepoints);
            &[]
        }
    };
    for &(program, tracepoint) in raw {
        load.push(load_as(ProgramKind::RawTracePoint)(program));
        attach.push(Attach::RawTracepoint {
            program,
            tracepoint,
        });
    }
    // With the per-thread switch events the samples are per thread too
    // (attached with them): no other task is interrupted.
    if scheduler != SchedulerProbes::ThreadEvents {
        attach.push(Attach::SampleEveryCpu {
            hz: request.sample_hz,
        });
    }
    (load, attach)
}

/// Agent delay the ring buffer absorbs at full sampling rate on every CPU.
/// The drain no longer waits on symbolization (`pipeline/symbolizer.rs`)
/// nor on a runtime's symbol table, but it is one thread on a loaded host:
/// with 100 ms (an 8 MiB ring for `record` on 2 CPUs when every stack event
/// took the full ~35 KiB) the demo lost 348 events once in 7 runs at a load
/// average of 10 on this 2-vCPU VM, the drain not scheduled for a quarter
/// of a second. The largest backlog a
/// drain found is logged at the end (`-v`: "at most N KiB waiting").
const RING_SLACK_MS: u64 = 125;
/// The smallest ring buffer: room for switch-outs and bursts beyond samples
/// (the daemon at 199 Hz: 0.5 s of both CPUs' stacks at the planned size,
/// 1.5 s at the 7 KiB a Python stack event measures). Its pages are
/// resident from attach, twice over (see [`ring_bytes`]).
const RING_MIN_BYTES: u32 = 4 << 20;

/// Ring-buffer size for `sample_hz` on `cpus` CPUs: every CPU sampling a
/// busy loop thread fills `RING_SLACK_MS` of it, as a power of two between
/// [`RING_MIN_BYTES`] and `RINGBUF_BYTES`. A stack event is sent cut to its
/// valid user-stack bytes; it is planned at 16 KiB of copy
/// ([`PLANNED_STACK_EVENT`]; the recordings of Python and C loops measure
/// 6–12 KiB, Node's deepest stacks up to the full 64). The agent maps the data
/// pages twice (for reads across the wrap), all of them resident from
/// attach, so its RSS holds twice this: sized to what the gate lets
/// through, not to the worst case.
pub fn ring_bytes(sample_hz: u64, cpus: u64) -> u32 {
    let per_sec = sample_hz * cpus * PLANNED_STACK_EVENT as u64;
    let want = (per_sec * RING_SLACK_MS / 1000).next_power_of_two();
    want.clamp(RING_MIN_BYTES as u64, profiler_common::RINGBUF_BYTES as u64) as u32
}

/// The ring space a stack event is planned to take: everything before the
/// user-stack copy, and 16 KiB of it (more than the 6–12 KiB most events
/// measure; the whole copy, 64 KiB, would double the ring and the agent's
/// RSS for the few deepest stacks).
const PLANNED_STACK_EVENT: usize =
    std::mem::offset_of!(profiler_common::StackEvent, stack) + (16 << 10);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::btf::{RawLayout, Unusable};

    #[test]
    fn ring_is_sized_to_the_sampling_rate() {
        // 2 CPUs at 999 Hz: ~5 MB of planned stack events in 125 ms -> 8 MiB.
        assert_eq!(ring_bytes(999, 2), 8 << 20);
        assert_eq!(ring_bytes(199, 2), RING_MIN_BYTES);
        assert_eq!(ring_bytes(999, 4), 16 << 20);
        assert_eq!(ring_bytes(999, 8), 32 << 20);
        assert_eq!(ring_bytes(10_000, 64), profiler_common::RINGBUF_BYTES);
    }

    const SWITCHES: SwitchLayout = SwitchLayout {
        task_state: 24,
        task_last_arrival: 1_000,
        task_cfs_rq: 300,
        cfs_rq_rq: 400,
        rq_clock: 500,
        rq_curr: 600,
        task_comm: 2_000,
    };
    const THROTTLE: ThrottleLayout = ThrottleLayout {
        model: profiler_common::throttle_model::TASK,
        task_throttled: 700,
        task_cfs_rq: 300,
        cfs_rq_throttle_count: 800,
        cfs_rq_self_time: 900,
    };

    /// A kernel with every layout (as this 6.18 one).
    fn full() -> KernelLayouts {
        KernelLayouts {
            raw: Ok(RawLayout {
                task_pid_offset: 1_500,
            }),
            switches: Ok(SWITCHES),
            throttle: Ok(THROTTLE),
            run_delay: Ok(992),
        }
    }

    fn plan(tgid: u32, choice: ProbeChoice, layouts: KernelLayouts) -> AttachPlan {
        plan_of(tgid, choice, layouts, false)
    }

    fn plan_of(
        tgid: u32,
        choice: ProbeChoice,
        layouts: KernelLayouts,
        subprocesses: bool,
    ) -> AttachPlan {
        let request = Request {
            tgid,
            sample_hz: 999,
            sample_after_ns: 1_000_000,
            choice,
            subprocesses,
        };
        let host = Host {
            layouts,
            cpus: 2,
            possible_cpus: 4,
        };
        AttachPlan::new(request, &host)
    }

    fn unusable(why: &str) -> Result<SwitchLayout, Unusable> {
        Err(Unusable(why.into()))
    }

    fn programs(p: &AttachPlan) -> Vec<&'static str> {
        p.load.iter().map(|l| l.program).collect()
    }

    #[test]
    fn by_default_one_process_is_watched_by_its_own_threads_events() {
        let p = plan(42, ProbeChoice::Auto, full());
        assert_eq!(
            p.probes,
            ProbeSet {
                scheduler: SchedulerProbes::ThreadEvents,
                waits: WaitProbes::Uprobes,
                notes: vec![],
            }
        );
        assert!(!p.probes.host_wide());
        assert!(!p.wait_tracepoints);
        assert_eq!(
            programs(&p),
            [
                "sp_park_enter",
                "sp_park_exit",
                "sp_uwait_enter",
                "sp_uwait_exit",
                "sp_sample",
                "sp_thread_switch",
                "sp_raw_exit"
            ]
        );
        assert_eq!(
            p.attach,
            [
                Attach::ThreadEvents { tgid: 42 },
                Attach::RawTracepoint {
                    program: "sp_raw_exit",
                    tracepoint: "sched_process_exit"
                },
            ]
        );
        assert_eq!(
            p.globals,
            Globals {
                target_tgid: 42,
                sample_after_ns: 1_000_000,
                task_pid_offset: 1_500,
                thread_switches: 1,
                throttle_model: THROTTLE.model,
                task_throttled_offset: 700,
                task_cfs_rq_offset: 300,
                cfs_rq_throttle_count_offset: 800,
                cfs_rq_self_time_offset: 900,
                task_state_offset: 24,
                task_last_arrival_offset: 1_000,
                cfs_rq_rq_offset: 400,
                rq_clock_offset: 500,
                rq_curr_offset: 600,
                task_comm_offset: 2_000,
                task_run_delay_offset: 992,
            }
        );
        assert_eq!(
            p.maps,
            MapSizes {
                events: 8 << 20,
                stack_scratch: 8
            }
        );
    }

    /// The daemon opens the switch events on each loop thread it elects,
    /// not at attach.
    /// A process tree: its forks are followed by a raw tracepoint attached
    /// before anything else, whatever serves the scheduler; never for the
    /// daemon; said when the kernel's BTF cannot give the child's ids.
    #[test]
    fn a_process_tree_follows_forks_first() {
        let fork = Attach::RawTracepoint {
            program: "sp_raw_fork",
            tracepoint: "sched_process_fork",
        };
        for choice in [
            ProbeChoice::Auto,
            ProbeChoice::RawTracepoints,
            ProbeChoice::Tracepoints,
        ] {
            let p = plan_of(42, choice, full(), true);
            assert_eq!(
                p.attach.iter().position(|a| *a == fork),
                Some(0),
                "{choice:?}"
            );
            assert!(programs(&p).contains(&"sp_raw_fork"));
            assert_eq!(p.globals.task_pid_offset, 1_500);
        }
        assert!(
            !plan_of(42, ProbeChoice::Auto, full(), false)
                .attach
                .contains(&fork)
        );
        assert!(
            !plan_of(0, ProbeChoice::Auto, full(), true)
                .attach
                .contains(&fork)
        );
        let mut k = full();
        k.raw = Err(Unusable("no BTF".into()));
        let p = plan_of(42, ProbeChoice::Auto, k, true);
        assert!(!p.attach.contains(&fork));
        assert!(
            p.probes
                .notes
                .iter()
                .any(|n| n.contains("processes started under the target after attach")),
            "{:?}",
            p.probes.notes
        );
    }

    #[test]
    fn the_daemon_attaches_no_thread_events_up_front() {
        let p = plan(0, ProbeChoice::Auto, full());
        assert_eq!(p.probes.scheduler, SchedulerProbes::ThreadEvents);
        assert_eq!(
            p.attach,
            [Attach::RawTracepoint {
                program: "sp_raw_exit",
                tracepoint: "sched_process_exit"
            }]
        );
        assert_eq!(p.globals.target_tgid, 0);
    }

    #[test]
    fn raw_tracepoints_as_asked_sample_every_cpu_and_say_so() {
        let p = plan(42, ProbeChoice::RawTracepoints, full());
        assert_eq!(p.probes.scheduler, SchedulerProbes::RawTracepoints);
        assert_eq!(p.probes.waits, WaitProbes::Uprobes);
        assert!(p.probes.host_wide());
        assert_eq!(p.probes.notes.len(), 1);
        assert!(p.probes.notes[0].starts_with("scheduler: raw tracepoints, as asked"));
        assert!(!programs(&p).contains(&"sp_thread_switch"));
        let raw = RAW_TRACEPOINTS.map(|(program, tracepoint)| Attach::RawTracepoint {
            program,
            tracepoint,
        });
        let mut want = raw.to_vec();
        want.push(Attach::SampleEveryCpu { hz: 999 });
        assert_eq!(p.attach, want);
        // No switch layout: only the throttling reader's task fields.
        assert_eq!(p.globals.thread_switches, 0);
        assert_eq!(p.globals.task_state_offset, 0);
        assert_eq!(p.globals.task_cfs_rq_offset, THROTTLE.task_cfs_rq);
        assert_eq!(p.globals.task_pid_offset, 1_500);
    }

    #[test]
    fn classic_tracepoints_as_asked_serve_waits_and_scheduler() {
        let p = plan(42, ProbeChoice::Tracepoints, full());
        assert_eq!(
            p.probes,
            ProbeSet {
                scheduler: SchedulerProbes::Tracepoints,
                waits: WaitProbes::Tracepoints,
                notes: vec!["classic tracepoints, as asked (--probes tracepoints)".into()],
            }
        );
        assert!(p.wait_tracepoints);
        assert_eq!(
            p.attach,
            [
                Attach::WaitTracepoints,
                Attach::SchedTracepoints,
                Attach::SampleEveryCpu { hz: 999 }
            ]
        );
        assert_eq!(programs(&p)[4..], ["sp_sample"]);
        assert_eq!(p.globals.task_pid_offset, 0);
        // Throttling and run delays are read whatever the scheduler.
        assert_eq!(p.globals.throttle_model, THROTTLE.model);
        assert_eq!(p.globals.task_run_delay_offset, 992);
    }

    #[test]
    fn a_kernel_without_btf_falls_back_to_classic_tracepoints_for_the_scheduler_only() {
        let why = Unusable("cannot read /sys/kernel/btf/vmlinux".into());
        let p = plan(42, ProbeChoice::Auto, KernelLayouts::none(why));
        assert_eq!(p.probes.scheduler, SchedulerProbes::Tracepoints);
        assert_eq!(p.probes.waits, WaitProbes::Uprobes);
        assert!(!p.wait_tracepoints);
        assert_eq!(
            p.probes.notes,
            [
                "scheduler: classic tracepoints, because cannot read /sys/kernel/btf/vmlinux: \
                 every context switch on the host builds a trace record while attached",
                "CPU throttling (cgroup CPU quota) is not told apart from run-queue waits, \
                 because cannot read /sys/kernel/btf/vmlinux",
                "a loop thread's wait for a CPU after its wakeup is not measured, because \
                 cannot read /sys/kernel/btf/vmlinux",
            ]
        );
        assert_eq!(
            p.attach,
            [Attach::SchedTracepoints, Attach::SampleEveryCpu { hz: 999 }]
        );
        assert_eq!(
            p.globals,
            Globals {
                target_tgid: 42,
                sample_after_ns: 1_000_000,
                ..Globals::default()
            }
        );
    }

    #[test]
    fn a_switch_field_missing_from_btf_falls_back_to_raw_tracepoints() {
        let layouts = KernelLayouts {
            switches: unusable("rq.curr is not in the kernel's BTF"),
            ..full()
        };
        let p = plan(42, ProbeChoice::Auto, layouts);
        assert_eq!(p.probes.scheduler, SchedulerProbes::RawTracepoints);
        assert_eq!(
            p.probes.notes,
            [
                "scheduler: raw tracepoints, because rq.curr is not in the kernel's BTF: every \
              context switch and wakeup on the host runs a program while attached"
            ]
        );
        assert_eq!(p.attach.len(), 4);
        assert_eq!(p.globals.thread_switches, 0);
        assert_eq!(p.globals.task_run_delay_offset, 992);
    }

    /// The per-thread events date a wakeup from the run delay: without it
    /// they cannot serve, and the run delay's absence is noted as well.
    #[test]
    fn no_run_delay_means_no_thread_events() {
        let layouts = KernelLayouts {
            run_delay: Err(Unusable("no CONFIG_SCHED_INFO".into())),
            ..full()
        };
        let p = plan(42, ProbeChoice::Auto, layouts);
        assert_eq!(p.probes.scheduler, SchedulerProbes::RawTracepoints);
        assert_eq!(p.probes.notes.len(), 2);
        assert!(p.probes.notes[0].contains("because no CONFIG_SCHED_INFO"));
        assert!(p.probes.notes[1].starts_with("a loop thread's wait for a CPU"));
        assert_eq!(p.globals.task_run_delay_offset, 0);
    }

    #[test]
    fn without_throttling_fields_the_switch_reader_keeps_its_cfs_rq() {
        let layouts = KernelLayouts {
            throttle: Err(Unusable("no CONFIG_CFS_BANDWIDTH".into())),
            ..full()
        };
        let p = plan(42, ProbeChoice::Auto, layouts);
        assert_eq!(p.probes.scheduler, SchedulerProbes::ThreadEvents);
        assert_eq!(p.globals.throttle_model, 0);
        assert_eq!(p.globals.task_cfs_rq_offset, SWITCHES.task_cfs_rq);
        assert!(p.probes.notes[0].starts_with("CPU throttling"));
    }

    #[test]
    fn every_global_is_named_once() {
        let names: Vec<&str> = Globals::default().each().iter().map(|g| g.0).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        let p = plan(7, ProbeChoice::Auto, full());
        let each = p.globals.each();
        assert!(each.contains(&("SAMPLE_AFTER_NS", GlobalValue::U64(1_000_000))));
        assert!(each.contains(&("TARGET_TGID", GlobalValue::U32(7))));
    }
}
