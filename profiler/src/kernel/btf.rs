//! The kernel's own description of its types (BTF), read for the two facts
//! the raw scheduler tracepoints need: where `task_struct.pid` sits (and
//! that `tgid` follows it), and that each raw tracepoint passes what the
//! programs expect (`btf_trace_<name>`'s prototype).
//!
//! In: `/sys/kernel/btf/vmlinux`, read once. Out: [`KernelLayouts`]: the
//! raw tracepoints' [`RawLayout`] (or why not — then the probes fall back
//! to the classic tracepoints, which need neither), and the task and run
//! queue fields the per-thread switch and throttling readers load.
//!
//! Constraints: a raw tracepoint has no record layout to check; its
//! arguments are the kernel function's, and a task field read at a wrong
//! offset reads another field without any error. So nothing is assumed:
//! both come from the running kernel's BTF, and a kernel without it (or
//! whose prototypes differ) is not given raw tracepoints. The format
//! (`include/uapi/linux/btf.h`) is small; this reads only what is needed
//! (aya's own BTF parser keeps struct members private; the crates that
//! expose them are LGPL).
use std::{collections::HashMap, fmt};

/// Where the raw tracepoint programs read a task's ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawLayout {
    /// Byte offset of `task_struct.pid`; `tgid` is the next 4 bytes.
    pub task_pid_offset: u32,
}

/// Why the raw tracepoints cannot be used on this kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unusable(pub String);

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

/// One type: kind, name, size-or-type, and where its trailing records are.
#[derive(Clone, Copy, Debug)]
struct Type {
    kind: u32,
    vlen: u32,
    kind_flag: bool,
    name_off: u32,
    size_or_type: u32,
    /// Offset of the records after the 12-byte header, in the type section.
    extra: usize,
}

/// A parsed BTF blob: its types (id 0 is `void`) and strings.
pub struct Btf<'a> {
    types: Vec<Type>,
    type_sec: &'a [u8],
    strings: &'a [u8],
    by_name: HashMap<&'a str, Vec<u32>>,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn bad(what: &str) -> Unusable {
    Unusable(format!("the kernel's BTF is malformed ({what})"))
}

impl<'a> Btf<'a> {
    pub fn parse(data: &'a [u8]) -> Result<Btf<'a>, Unusable> {
        if data.len() < 24 || data[..2] != [0x9f, 0xeb] {
            return Err(bad("no BTF magic, or not little-endian"));
        }
        let hdr_len = u32_at(data, 4).ok_or_else(|| bad("header"))? as usize;
        let field = |i: usize| u32_at(data, 8 + 4 * i).map(|v| v as usize);
        let (Some(type_off), Some(type_len), Some(str_off), Some(str_len)) =
            (field(0), field(1), field(2), field(3))
        else {
            return Err(bad("header"));
        };
        let section = |off: usize, len: usize| {
            let start = hdr_len.checked_add(off)?;
            data.get(start..start.checked_add(len)?)
        };
        let type_sec = section(type_off, type_len).ok_or_else(|| bad("type section"))?;
        let strings = section(str_off, str_len).ok_or_else(|| bad("string section"))?;
        let mut types = vec![Type {
            kind: 0,
            vlen: 0,
            kind_flag: false,
            name_off: 0,
            size_or_type: 0,
            extra: 0,
        }];
        let mut at = 0;
        while at < type_sec.len() {
            let name_off = u32_at(type_sec, at).ok_or_else(|| bad("type header"))?;
            let info = u32_at(type_sec, at + 4).ok_or_else(|| bad("type header"))?;
            let size_or_type = u32_at(type_sec, at + 8).ok_or_else(|| bad("type header"))?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let extra = at + 12;
            let trailing = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
                0..=19 => 0,
                _ => return Err(bad(&format!("unknown kind {kind}"))),
            };
            types.push(Type {
                kind,
                vlen: vlen as u32,
                kind_flag: info >> 31 != 0,
                name_off,
                size_or_type,
                extra,
            });
            at = extra + trailing;
        }
        let mut btf = Btf {
            types,
            type_sec,
            strings,
            by_name: HashMap::new(),
        };
        for id in 1..btf.types.len() as u32 {
            let name = btf.name(btf.types[id as usize].name_off);
            if !name.is_empty() {
                btf.by_name.entry(name).or_default().push(id);
            }
        }
        Ok(btf)
    }

    fn name(&self, off: u32) -> &'a str {
        let Some(rest) = self.strings.get(off as usize..) else {
            return "";
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn ty(&self, id: u32) -> Option<&Type> {
        self.types.get(id as usize)
    }

    fn named(&self, name: &str, kind: u32) -> Option<u32> {
        self.by_name
            .get(name)?
            .iter()
            .copied()
            .find(|&id| self.ty(id).is_some_and(|t| t.kind == kind))
    }

    /// Past typedefs and qualifiers (bounded: a loop in the types ends it).
    fn resolve(&self, mut id: u32) -> Option<u32> {
        for _ in 0..32 {
            let t = self.ty(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type
                }
                _ => return Some(id),
            }
        }
        None
    }

    /// (name, type, bit offset) of each member of a struct or union.
    fn members(&self, id: u32) -> Vec<(&'a str, u32, u32)> {
        let Some(t) = self.ty(id) else {
            return Vec::new();
        };
        if t.kind != KIND_STRUCT && t.kind != KIND_UNION {
            return Vec::new();
        }
        (0..t.vlen as usize)
            .filter_map(|i| {
                let at = t.extra + 12 * i;
                let name = self.name(u32_at(self.type_sec, at)?);
                let ty = u32_at(self.type_sec, at + 4)?;
                let off = u32_at(self.type_sec, at + 8)?;
                // With kind_flag, the low 24 bits are the offset (bitfields).
                let bits = if t.kind_flag { off & 0xff_ffff } else { off };
                Some((name, ty, bits))
            })
            .collect()
    }

    /// Byte offset and size of member `name` of struct `id`, looking into
    /// anonymous structs and unions (`task_struct` keeps some fields in
    /// one with randomized layouts).
    fn member(&self, id: u32, name: &str, depth: u32) -> Option<(u32, u32)> {
        if depth > 8 {
            return None;
        }
        for (m, ty, bits) in self.members(id) {
            if m == name {
                let size = self.size(ty)?;
                return (bits % 8 == 0).then_some((bits / 8, size));
            }
            if m.is_empty()
                && let Some(inner) = self.resolve(ty)
                && let Some((off, size)) = self.member(inner, name, depth + 1)
            {
                return Some((bits / 8 + off, size));
            }
        }
        None
    }

    fn size(&self, id: u32) -> Option<u32> {
        let t = self.ty(self.resolve(id)?)?;
        match t.kind {
            KIND_INT | KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 => Some(t.size_or_type),
            KIND_PTR => Some(8),
            // struct btf_array { type, index_type, nelems }
            KIND_ARRAY => {
                let elem = u32_at(self.type_sec, t.extra)?;
                let n = u32_at(self.type_sec, t.extra + 8)?;
                self.size(elem)?.checked_mul(n)
            }
            _ => None,
        }
    }

    /// The parameter types of raw tracepoint `name` (`btf_trace_<name>`: a
    /// pointer to a function whose first parameter is the probe's `void *`).
    fn raw_tp_params(&self, name: &str) -> Option<Vec<u32>> {
        let td = self.named(&format!("btf_trace_{name}"), KIND_TYPEDEF)?;
        let ptr = self.ty(self.ty(td)?.size_or_type)?;
        if ptr.kind != KIND_PTR {
            return None;
        }
        let proto = self.ty(ptr.size_or_type)?;
        if proto.kind != KIND_FUNC_PROTO {
            return None;
        }
        (0..proto.vlen as usize)
            .map(|i| u32_at(self.type_sec, proto.extra + 8 * i + 4))
            .collect()
    }

    /// What a parameter type is, as the checks spell it.
    fn describe(&self, id: u32) -> String {
        let Some(rid) = self.resolve(id) else {
            return "?".into();
        };
        let Some(t) = self.ty(rid) else {
            return "?".into();
        };
        match t.kind {
            0 => "void".into(),
            KIND_PTR => {
                let to = self.resolve(t.size_or_type).and_then(|p| self.ty(p));
                match to {
                    Some(p) if p.kind == KIND_STRUCT => {
                        format!("struct {} *", self.name(p.name_off))
                    }
                    Some(p) if p.kind == 0 => "void *".into(),
                    _ => "pointer".into(),
                }
            }
            KIND_INT => format!("int{}", t.size_or_type * 8),
            _ => format!("kind {}", t.kind),
        }
    }
}

/// What each raw tracepoint program reads, by argument position (after the
/// probe's own `void *`): the prototype must match exactly.
pub const RAW_PROTOTYPES: [(&str, &[&str]); 3] = [
    (
        "sched_switch",
        &[
            "void *",
            "int8",
            "struct task_struct *",
            "struct task_struct *",
            "int32",
        ],
    ),
    ("sched_wakeup", &["void *", "struct task_struct *"]),
    (
        "sched_process_exit",
        &["void *", "struct task_struct *", "int8"],
    ),
];

/// The layout the raw tracepoint programs need, from a BTF blob.
pub fn raw_layout(data: &[u8]) -> Result<RawLayout, Unusable> {
    let btf = Btf::parse(data)?;
    for (tp, want) in RAW_PROTOTYPES {
        let params = btf
            .raw_tp_params(tp)
            .ok_or_else(|| Unusable(format!("the kernel's BTF has no btf_trace_{tp}")))?;
        let found: Vec<String> = params.iter().map(|&p| btf.describe(p)).collect();
        if found != want {
            return Err(Unusable(format!(
                "raw tracepoint {tp} passes ({}) on this kernel, stallprof's programs read ({})",
                found.join(", "),
                want.join(", ")
            )));
        }
    }
    let task = btf
        .named("task_struct", KIND_STRUCT)
        .ok_or_else(|| Unusable("the kernel's BTF has no struct task_struct".into()))?;
    let pid = btf.member(task, "pid", 0);
    let tgid = btf.member(task, "tgid", 0);
    match (pid, tgid) {
        (Some((p, 4)), Some((t, 4))) if t == p + 4 => Ok(RawLayout { task_pid_offset: p }),
        _ => Err(Unusable(format!(
            "task_struct.pid/tgid are not two adjacent 4-byte fields on this kernel \
             (pid {pid:?}, tgid {tgid:?}: offset, size)"
        ))),
    }
}

/// Where the fields that tell a CFS-throttled task are, for
/// `profiler_common::throttle_model` (BPF globals `THROTTLE_MODEL`,
/// `TASK_THROTTLED_OFFSET`, `TASK_CFS_RQ_OFFSET`,
/// `CFS_RQ_THROTTLE_COUNT_OFFSET`, `CFS_RQ_SELF_TIME_OFFSET`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThrottleLayout {
    pub model: u32,
    pub task_throttled: u32,
    /// `task_struct.se` + `sched_entity.cfs_rq`.
    pub task_cfs_rq: u32,
    pub cfs_rq_throttle_count: u32,
    /// 0: the kernel has no `throttled_clock_self_time` (before 6.7): the
    /// throttled share of a wait is not measured.
    pub cfs_rq_self_time: u32,
}

/// The throttling layout of a BTF blob: `Err` says why throttled
/// preemptions cannot be told apart on this kernel.
pub fn throttle_layout(data: &[u8]) -> Result<ThrottleLayout, Unusable> {
    use profiler_common::throttle_model;
    let btf = Btf::parse(data)?;
    let st = |name: &str| struct_id(&btf, name);
    let (task, rq) = (st("task_struct")?, st("cfs_rq")?);
    let field = |id: u32, name: &str, size: Option<u32>| field(&btf, id, name, size);
    let task_cfs_rq = task_cfs_rq(&btf)?;
    let task_throttled = field(task, "throttled", Some(1));
    let throttle_count = field(rq, "throttle_count", Some(4));
    let model = throttle_model::from_btf(task_throttled.is_some(), throttle_count.is_some());
    if model == throttle_model::UNKNOWN {
        return Err(Unusable(
            "neither task_struct.throttled (6.18+) nor cfs_rq.throttle_count is in the \
             kernel's BTF (no CONFIG_CFS_BANDWIDTH?)"
                .into(),
        ));
    }
    Ok(ThrottleLayout {
        model,
        task_throttled: task_throttled.unwrap_or(0),
        task_cfs_rq,
        cfs_rq_throttle_count: throttle_count.unwrap_or(0),
        cfs_rq_self_time: field(rq, "throttled_clock_self_time", Some(8)).unwrap_or(0),
    })
}

/// The offset of member `name` of struct `id` when its size is `size`
/// (any size: `None`).
fn field(btf: &Btf, id: u32, name: &str, size: Option<u32>) -> Option<u32> {
    match btf.member(id, name, 0) {
        Some((off, s)) if size.is_none_or(|want| want == s) => Some(off),
        _ => None,
    }
}

/// The id of struct `name`, or why it cannot be read.
fn struct_id(btf: &Btf, name: &str) -> Result<u32, Unusable> {
    btf.named(name, KIND_STRUCT)
        .ok_or_else(|| Unusable(format!("the kernel's BTF has no struct {name}")))
}

/// Offset of `task_struct.se.cfs_rq` (a task's CFS run queue: its group's
/// on its CPU), where the throttling and per-thread switch readers start.
fn task_cfs_rq(btf: &Btf) -> Result<u32, Unusable> {
    let task = btf.named("task_struct", KIND_STRUCT);
    let se = btf.named("sched_entity", KIND_STRUCT);
    match (
        task.and_then(|t| field(btf, t, "se", None)),
        se.and_then(|s| field(btf, s, "cfs_rq", Some(8))),
    ) {
        (Some(se_off), Some(cfs_rq)) => Ok(se_off + cfs_rq),
        _ => Err(Unusable(
            "task_struct.se.cfs_rq is not where stallprof reads it (no CFS group scheduling?)"
                .into(),
        )),
    }
}

/// Where the per-thread switch program reads (BPF globals
/// `TASK_STATE_OFFSET`, `TASK_LAST_ARRIVAL_OFFSET`, `TASK_CFS_RQ_OFFSET`,
/// `CFS_RQ_RQ_OFFSET`, `RQ_CLOCK_OFFSET`, `RQ_CURR_OFFSET`,
/// `TASK_COMM_OFFSET`): whether the thread leaving blocked, and — as no
/// program sees it come back — when it did, against its run queue's clock
/// at the switch-out; and which task takes the CPU from a preempted one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwitchLayout {
    /// `task_struct.__state` (4 bytes; the low half of `state` before 5.14).
    pub task_state: u32,
    /// `task_struct.sched_info.last_arrival` (8 bytes, `CONFIG_SCHED_INFO`).
    pub task_last_arrival: u32,
    pub task_cfs_rq: u32,
    /// `cfs_rq.rq` (`CONFIG_FAIR_GROUP_SCHED`).
    pub cfs_rq_rq: u32,
    /// `rq.clock`.
    pub rq_clock: u32,
    /// `rq.curr` (8 bytes): at a switch-out's perf event the scheduler has
    /// already made it the next task.
    pub rq_curr: u32,
    /// `task_struct.comm` (16 bytes).
    pub task_comm: u32,
}

/// The per-thread switch layout of a BTF blob: `Err` says why this kernel
/// needs the host-wide scheduler tracepoints.
pub fn switch_layout(data: &[u8]) -> Result<SwitchLayout, Unusable> {
    let btf = Btf::parse(data)?;
    let st = |name: &str| struct_id(&btf, name);
    let (task, info, cfs_rq, rq) = (
        st("task_struct")?,
        st("sched_info")?,
        st("cfs_rq")?,
        st("rq")?,
    );
    let missing = |what: &str| Unusable(format!("{what} is not in the kernel's BTF"));
    let task_state = field(&btf, task, "__state", Some(4))
        .or_else(|| field(&btf, task, "state", Some(8)))
        .ok_or_else(|| missing("task_struct.__state"))?;
    let task_last_arrival = match (
        field(&btf, task, "sched_info", None),
        field(&btf, info, "last_arrival", Some(8)),
    ) {
        (Some(at), Some(off)) => at + off,
        _ => {
            return Err(missing(
                "task_struct.sched_info.last_arrival (CONFIG_SCHED_INFO)",
            ));
        }
    };
    Ok(SwitchLayout {
        task_state,
        task_last_arrival,
        task_cfs_rq: task_cfs_rq(&btf)?,
        cfs_rq_rq: field(&btf, cfs_rq, "rq", Some(8))
            .ok_or_else(|| missing("cfs_rq.rq (CONFIG_FAIR_GROUP_SCHED)"))?,
        rq_clock: field(&btf, rq, "clock", Some(8)).ok_or_else(|| missing("rq.clock"))?,
        rq_curr: field(&btf, rq, "curr", Some(8)).ok_or_else(|| missing("rq.curr"))?,
        task_comm: field(&btf, task, "comm", Some(16))
            .ok_or_else(|| missing("task_struct.comm"))?,
    })
}

/// Offset of `task_struct.sched_info.run_delay` (an 8-byte count of the ns
/// a task ever waited runnable for a CPU, kept with `CONFIG_SCHED_INFO`):
/// how long a loop thread woken in its park waited for a CPU, read at the
/// wait's return (BPF global `TASK_RUN_DELAY_OFFSET`).
pub fn run_delay_offset(data: &[u8]) -> Result<u32, Unusable> {
    let btf = Btf::parse(data)?;
    let in_task = btf
        .named("task_struct", KIND_STRUCT)
        .and_then(|task| btf.member(task, "sched_info", 0));
    let info = btf.named("sched_info", KIND_STRUCT);
    match (in_task, info.and_then(|i| btf.member(i, "run_delay", 0))) {
        (Some((at, _)), Some((off, 8))) => Ok(at + off),
        _ => Err(Unusable(
            "task_struct.sched_info.run_delay is not in the kernel's BTF (no CONFIG_SCHED_INFO)"
                .into(),
        )),
    }
}

fn vmlinux() -> Result<Vec<u8>, Unusable> {
    std::fs::read(VMLINUX).map_err(|e| {
        Unusable(format!(
            "cannot read {VMLINUX} ({e}): the kernel has no BTF (CONFIG_DEBUG_INFO_BTF)"
        ))
    })
}

const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// Every layout the programs may be given, each read from one BTF blob, or
/// why this kernel cannot give it: what the kernel offers each probe mode,
/// read before the attach plan (`kernel::plan`) chooses among them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelLayouts {
    pub raw: Result<RawLayout, Unusable>,
    pub switches: Result<SwitchLayout, Unusable>,
    pub throttle: Result<ThrottleLayout, Unusable>,
    pub run_delay: Result<u32, Unusable>,
}

impl KernelLayouts {
    /// The layouts of BTF blob `data`.
    pub fn of(data: &[u8]) -> KernelLayouts {
        KernelLayouts {
            raw: raw_layout(data),
            switches: switch_layout(data),
            throttle: throttle_layout(data),
            run_delay: run_delay_offset(data),
        }
    }

    /// The running kernel's, from one read of its BTF.
    pub fn running_kernel() -> KernelLayouts {
        match vmlinux() {
            Ok(data) => KernelLayouts::of(&data),
            Err(why) => KernelLayouts::none(why),
        }
    }

    /// None of them, all for the same reason (a kernel without BTF).
    pub fn none(why: Unusable) -> KernelLayouts {
        KernelLayouts {
            raw: Err(why.clone()),
            switches: Err(why.clone()),
            throttle: Err(why.clone()),
            run_delay: Err(why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob built by hand: types as (kind, vlen, name, size_or_type,
    /// trailing u32s), names interned.
    struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
        next: u32,
    }

    impl Builder {
        fn new() -> Self {
            Builder {
                types: Vec::new(),
                strings: vec![0],
                next: 1,
            }
        }
        fn s(&mut self, name: &str) -> u32 {
            if name.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(name.as_bytes());
            self.strings.push(0);
            off
        }
        fn ty(&mut self, kind: u32, vlen: u32, name: &str, size_or_type: u32, tail: &[u32]) -> u32 {
            let n = self.s(name);
            for v in [n, (kind << 24) | vlen, size_or_type] {
                self.types.extend_from_slice(&v.to_le_bytes());
            }
            for v in tail {
                self.types.extend_from_slice(&v.to_le_bytes());
            }
            self.next += 1;
            self.next - 1
        }
        fn member(&mut self, name: &str, ty: u32, bits: u32) -> [u32; 3] {
            [self.s(name), ty, bits]
        }
        fn bytes(self) -> Vec<u8> {
            let mut out = vec![0x9f, 0xeb, 1, 0];
            let hdr_len = 24u32;
            for v in [
                hdr_len,
                0,
                self.types.len() as u32,
                self.types.len() as u32,
                self.strings.len() as u32,
            ] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&self.types);
            out.extend_from_slice(&self.strings);
            out
        }
    }

    /// A kernel like 6.18's: pid/tgid inside an anonymous struct at 0x100,
    /// the three prototypes as given.
    fn kernel(exit_group_dead: bool, tgid_gap: u32) -> Vec<u8> {
        let mut b = Builder::new();
        let int = b.ty(KIND_INT, 0, "int", 4, &[32]);
        let boolean = b.ty(KIND_INT, 0, "_Bool", 1, &[8]);
        let uint = b.ty(KIND_INT, 0, "unsigned int", 4, &[32]);
        let pid_t = b.ty(KIND_TYPEDEF, 0, "pid_t", int, &[]);
        let m1 = b.member("pid", pid_t, 0);
        let m2 = b.member("tgid", pid_t, 32 + tgid_gap);
        let anon = b.ty(KIND_STRUCT, 2, "", 16, &[m1, m2].concat());
        let m3 = b.member("state", uint, 0);
        let m4 = b.member("", anon, 0x100 * 8);
        let task = b.ty(KIND_STRUCT, 2, "task_struct", 0x200, &[m3, m4].concat());
        let task_ptr = b.ty(KIND_PTR, 0, "", task, &[]);
        let void_ptr = b.ty(KIND_PTR, 0, "", 0, &[]);
        let proto = |b: &mut Builder, params: &[u32]| {
            let tail: Vec<u32> = params.iter().flat_map(|&p| [0, p]).collect();
            let f = b.ty(KIND_FUNC_PROTO, params.len() as u32, "", 0, &tail);
            b.ty(KIND_PTR, 0, "", f, &[])
        };
        let sw = proto(&mut b, &[void_ptr, boolean, task_ptr, task_ptr, uint]);
        b.ty(KIND_TYPEDEF, 0, "btf_trace_sched_switch", sw, &[]);
        let wk = proto(&mut b, &[void_ptr, task_ptr]);
        b.ty(KIND_TYPEDEF, 0, "btf_trace_sched_wakeup", wk, &[]);
        let ex = if exit_group_dead {
            proto(&mut b, &[void_ptr, task_ptr, boolean])
        } else {
            proto(&mut b, &[void_ptr, task_ptr])
        };
        b.ty(KIND_TYPEDEF, 0, "btf_trace_sched_process_exit", ex, &[]);
        b.bytes()
    }

    #[test]
    fn pid_is_found_inside_an_anonymous_struct() {
        let layout = raw_layout(&kernel(true, 0)).unwrap();
        assert_eq!(layout.task_pid_offset, 0x100);
    }

    #[test]
    fn a_different_prototype_is_refused_by_name() {
        let err = raw_layout(&kernel(false, 0)).unwrap_err();
        assert!(err.0.contains("sched_process_exit"), "{err}");
        assert!(err.0.contains("(void *, struct task_struct *)"), "{err}");
    }

    #[test]
    fn pid_and_tgid_apart_are_refused() {
        let err = raw_layout(&kernel(true, 32)).unwrap_err();
        assert!(err.0.contains("adjacent"), "{err}");
    }

    #[test]
    fn garbage_is_refused_not_a_panic() {
        assert!(raw_layout(b"").is_err());
        assert!(raw_layout(&[0x9f, 0xeb, 1, 0, 255, 255, 255, 255]).is_err());
        let mut k = kernel(true, 0);
        k.truncate(k.len() / 2);
        assert!(raw_layout(&k).is_err());
    }

    /// The running kernel (6.18 here) is given raw tracepoints.
    #[test]
    fn this_kernel_tells_throttled_tasks_by_their_flag() {
        let l = KernelLayouts::running_kernel()
            .throttle
            .expect("this 6.18 kernel has CFS bandwidth in its BTF");
        assert_eq!(l.model, profiler_common::throttle_model::TASK);
        assert!(l.task_throttled > 0 && l.task_cfs_rq > 0 && l.cfs_rq_self_time > 0);
    }

    /// This kernel keeps run delays (`/proc/PID/schedstat`'s second field).
    #[test]
    fn this_kernel_has_the_per_thread_switch_layout() {
        let l = KernelLayouts::running_kernel()
            .switches
            .expect("BTF with sched_info and group scheduling here");
        let pid = KernelLayouts::running_kernel().raw.unwrap().task_pid_offset;
        let delay = KernelLayouts::running_kernel().run_delay.unwrap();
        assert!(l.task_state > 0 && l.task_state < pid, "{l:?}");
        // Both in task_struct.sched_info, last_arrival after run_delay.
        let arrival = l.task_last_arrival;
        assert!(
            arrival > delay && arrival <= delay + 40,
            "{l:?}, run_delay at {delay}"
        );
        assert_eq!(
            l.task_cfs_rq,
            KernelLayouts::running_kernel()
                .throttle
                .unwrap()
                .task_cfs_rq
        );
        assert!(l.cfs_rq_rq > 0 && l.rq_clock > 0 && l.rq_curr > 0, "{l:?}");
        // comm comes after the ids, inside task_struct.
        assert!(l.task_comm > pid, "{l:?}");
        assert!(switch_layout(b"").is_err());
    }

    #[test]
    fn this_kernel_keeps_run_delays() {
        let off = KernelLayouts::running_kernel()
            .run_delay
            .expect("CONFIG_SCHED_INFO=y here");
        let pid = KernelLayouts::running_kernel().raw.unwrap().task_pid_offset;
        assert!(off > 0 && off != pid, "run_delay at {off}");
        assert!(run_delay_offset(b"").is_err());
        assert!(
            run_delay_offset(&kernel(true, 0)).is_err(),
            "no sched_info in it"
        );
    }

    #[test]
    fn this_kernel_has_a_usable_layout() {
        if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
            panic!("/sys/kernel/btf/vmlinux missing: this machine's kernel has no BTF");
        }
        let layout = KernelLayouts::running_kernel().raw.unwrap();
        assert!(layout.task_pid_offset > 0);
    }
}
