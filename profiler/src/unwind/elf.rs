//! The parts of an ELF file the unwinder needs (load segments, unwind
//! sections), parsed once per file; how a recording keeps them
//! ([`UnwindBundle`]) and where modules come from ([`Source`]).

use super::*;

/// A `PT_LOAD` program header, enough to map a file offset to an SVMA.
#[derive(Clone, Copy, Debug)]
pub(super) struct LoadSegment {
    pub(super) offset: u64,
    pub(super) vaddr: u64,
    pub(super) filesz: u64,
    pub(super) exec: bool,
}

/// The parts of an ELF file framehop needs, parsed once per file.
pub(super) struct ElfUnwindInfo {
    pub(super) loads: Vec<LoadSegment>,
    /// Lowest `PT_LOAD` vaddr, page-aligned down; the module's base SVMA.
    pub(super) base_svma: u64,
    pub(super) text_svma: Option<Range<u64>>,
    pub(super) got_svma: Option<Range<u64>>,
    pub(super) eh_frame: Option<(Range<u64>, Data)>,
    pub(super) eh_frame_hdr: Option<(Range<u64>, Data)>,
    pub(super) debug_frame: Option<Data>,
    /// FDEs framehop cannot evaluate, found on first need (see [`SlowFdes`]).
    pub(super) slow: OnceLock<SlowFdes>,
}

impl ElfUnwindInfo {
    pub(super) fn parse<'d, R: ReadRef<'d>>(data: R) -> Option<Self> {
        let file = object::File::parse(data).ok()?;
        if file.format() != object::BinaryFormat::Elf
            || file.architecture() != object::Architecture::X86_64
        {
            return None;
        }
        let loads: Vec<LoadSegment> = file
            .segments()
            .filter_map(|s| {
                let (offset, filesz) = s.file_range();
                let exec = match s.flags() {
                    object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
                    _ => false,
                };
                Some(LoadSegment {
                    offset,
                    vaddr: s.address(),
                    filesz,
                    exec,
                })
                .filter(|_| filesz > 0)
            })
            .collect();
        if loads.is_empty() {
            return None;
        }
        let base_svma = loads.iter().map(|l| l.vaddr).min().unwrap_or(0) & !0xfff;
        let range_of = |name: &str| {
            let s = file.section_by_name(name)?;
            Some(s.address()..s.address().checked_add(s.size())?)
        };
        let data_of = |name: &str| -> Option<Data> {
            let s = file.section_by_name(name)?;
            // Compressed sections would need inflating; skip them.
            let c = s.compressed_file_range().ok()?;
            if c.format != object::CompressionFormat::None {
                return None;
            }
            if c.uncompressed_size > limits::ELF_SECTION_MAX {
                limits::hit(limits::Limit::ElfTooLarge);
                return None;
            }
            let d = s.data().ok()?;
            (!d.is_empty()).then(|| Arc::from(d))
        };
        let with_range =
            |name: &str| -> Option<(Range<u64>, Data)> { Some((range_of(name)?, data_of(name)?)) };
        let mut eh_frame = with_range(".eh_frame");
        let mut debug_frame = data_of(".debug_frame");
        // framehop uses one CFI section per module and ignores .debug_frame when
        // there is an .eh_frame. Both exist when some objects were built without
        // unwind tables but with -g (then .eh_frame covers little more than the
        // C runtime's start files): use the larger, which covers more code.
        match (&eh_frame, &debug_frame) {
            (Some(e), Some(d)) if d.len() > e.1.len() => eh_frame = None,
            (Some(_), Some(_)) => debug_frame = None,
            _ => {}
        }
        let eh_frame_hdr = if eh_frame.is_some() {
            with_range(".eh_frame_hdr")
        } else {
            None
        };
        Some(ElfUnwindInfo {
            loads,
            base_svma,
            text_svma: range_of(".text"),
            got_svma: range_of(".got"),
            eh_frame,
            eh_frame_hdr,
            debug_frame,
            slow: OnceLock::new(),
        })
    }

    /// The CFI section framehop uses for this file (`.eh_frame`, else
    /// `.debug_frame`), with its base addresses (as framehop sets them).
    pub(super) fn cfi(&self) -> Option<(CfiSection<'_>, BaseAddresses)> {
        let start = |r: &Option<Range<u64>>| r.as_ref().map_or(0, |r| r.start);
        let bases = BaseAddresses::default()
            .set_eh_frame(self.eh_frame.as_ref().map_or(0, |e| e.0.start))
            .set_eh_frame_hdr(self.eh_frame_hdr.as_ref().map_or(0, |e| e.0.start))
            .set_text(start(&self.text_svma))
            .set_got(start(&self.got_svma));
        let section = match (&self.eh_frame, &self.debug_frame) {
            (Some((_, d)), _) => {
                let mut s = EhFrame::new(d, LittleEndian);
                s.set_address_size(8);
                CfiSection::Eh(s)
            }
            (None, Some(d)) => {
                let mut s = DebugFrame::new(d, LittleEndian);
                s.set_address_size(8);
                CfiSection::Debug(s)
            }
            (None, None) => return None,
        };
        Some((section, bases))
    }

    pub(super) fn slow_fdes(&self) -> &SlowFdes {
        self.slow.get_or_init(|| match self.cfi() {
            Some((CfiSection::Eh(s), bases)) => SlowFdes::scan(&s, &bases),
            Some((CfiSection::Debug(s), bases)) => SlowFdes::scan(&s, &bases),
            None => SlowFdes::default(),
        })
    }

    /// Whether a process's module still holds this file's section data.
    pub(super) fn in_use(&self) -> bool {
        let held = |d: &Data| Arc::strong_count(d) > 1;
        self.eh_frame.as_ref().is_some_and(|e| held(&e.1))
            || self.eh_frame_hdr.as_ref().is_some_and(|e| held(&e.1))
            || self.debug_frame.as_ref().is_some_and(held)
    }

    pub(super) fn bytes(&self) -> usize {
        self.eh_frame.as_ref().map_or(0, |e| e.1.len())
            + self.eh_frame_hdr.as_ref().map_or(0, |e| e.1.len())
            + self.debug_frame.as_ref().map_or(0, |d| d.len())
    }

    /// Load bias (AVMA - SVMA) of a mapping of this file at `start` from file
    /// offset `file_offset`.
    pub(super) fn bias(&self, start: u64, file_offset: u64) -> Option<u64> {
        // Adjacent segments can share a page, so several may contain the
        // offset: the mapping is executable, prefer the executable segment.
        let contains = |l: &&LoadSegment| {
            file_offset >= l.offset & !0xfff && file_offset < l.offset.saturating_add(l.filesz)
        };
        let seg = (self.loads.iter().filter(contains).find(|l| l.exec))
            .or_else(|| {
                self.loads
                    .iter()
                    .filter(contains)
                    .find(|l| l.offset & !0xfff == file_offset)
            })
            .or_else(|| self.loads.iter().find(contains))
            .or_else(|| self.loads.iter().find(|l| l.exec))?;
        // SVMA of the mapping's first byte.
        let svma = seg.vaddr.wrapping_add(file_offset).wrapping_sub(seg.offset);
        Some(start.wrapping_sub(svma))
    }

    /// The framehop module for a mapping of this file, and its load bias.
    pub(super) fn module(
        &self,
        name: &str,
        avma: Range<u64>,
        file_offset: u64,
    ) -> Option<(Module<Data>, u64)> {
        let bias = self.bias(avma.start, file_offset)?;
        let base_avma = bias.checked_add(self.base_svma)?;
        if base_avma > avma.start {
            return None;
        }
        let info = ExplicitModuleSectionInfo {
            base_svma: self.base_svma,
            text_svma: self.text_svma.clone(),
            got_svma: self.got_svma.clone(),
            eh_frame_svma: self.eh_frame.as_ref().map(|e| e.0.clone()),
            eh_frame: self.eh_frame.as_ref().map(|e| e.1.clone()),
            eh_frame_hdr_svma: self.eh_frame_hdr.as_ref().map(|e| e.0.clone()),
            eh_frame_hdr: self.eh_frame_hdr.as_ref().map(|e| e.1.clone()),
            debug_frame: self.debug_frame.clone(),
            ..Default::default()
        };
        Some((Module::new(name.to_string(), avma, base_avma, info), bias))
    }
}

/// One file's unwind sections as a recording keeps them (see
/// [`UnwindBundle`]); section bytes as hex.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct SavedElf {
    /// (offset, vaddr, filesz, exec) of each `PT_LOAD`.
    pub(super) loads: Vec<(u64, u64, u64, bool)>,
    pub(super) base_svma: u64,
    pub(super) text_svma: Option<(u64, u64)>,
    pub(super) got_svma: Option<(u64, u64)>,
    pub(super) eh_frame: Option<(u64, u64, String)>,
    pub(super) eh_frame_hdr: Option<(u64, u64, String)>,
    pub(super) debug_frame: Option<String>,
}

pub(super) fn hex(d: &[u8]) -> String {
    let mut s = String::with_capacity(d.len() * 2);
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

pub(super) fn unhex(s: &str) -> Option<Data> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    let v: Option<Vec<u8>> = b
        .chunks_exact(2)
        .map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
        .collect();
    v.map(Arc::from)
}

impl ElfUnwindInfo {
    pub(super) fn save(&self) -> SavedElf {
        let range = |r: &Option<Range<u64>>| r.as_ref().map(|r| (r.start, r.end));
        let sect =
            |e: &Option<(Range<u64>, Data)>| e.as_ref().map(|(r, d)| (r.start, r.end, hex(d)));
        SavedElf {
            loads: self
                .loads
                .iter()
                .map(|l| (l.offset, l.vaddr, l.filesz, l.exec))
                .collect(),
            base_svma: self.base_svma,
            text_svma: range(&self.text_svma),
            got_svma: range(&self.got_svma),
            eh_frame: sect(&self.eh_frame),
            eh_frame_hdr: sect(&self.eh_frame_hdr),
            debug_frame: self.debug_frame.as_ref().map(|d| hex(d)),
        }
    }

    pub(super) fn restore(s: &SavedElf) -> Option<Self> {
        let sect = |e: &Option<(u64, u64, String)>| -> Option<Option<(Range<u64>, Data)>> {
            match e {
                None => Some(None),
                Some((a, b, h)) => Some(Some((*a..*b, unhex(h)?))),
            }
        };
        Some(ElfUnwindInfo {
            loads: s
                .loads
                .iter()
                .map(|&(offset, vaddr, filesz, exec)| LoadSegment {
                    offset,
                    vaddr,
                    filesz,
                    exec,
                })
                .collect(),
            base_svma: s.base_svma,
            text_svma: s.text_svma.map(|(a, b)| a..b),
            got_svma: s.got_svma.map(|(a, b)| a..b),
            eh_frame: sect(&s.eh_frame)?,
            eh_frame_hdr: sect(&s.eh_frame_hdr)?,
            debug_frame: match &s.debug_frame {
                None => None,
                Some(h) => Some(unhex(h)?),
            },
            slow: OnceLock::new(),
        })
    }
}

/// What unwinding a recording again needs: each process's executable
/// mappings (lines of `/proc/PID/maps`, every one seen while recording)
/// and each mapped file's unwind sections, by the `dev inode` the maps name
/// (`[vdso]` for the vDSO).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UnwindBundle {
    pub(super) maps: BTreeMap<u32, BTreeMap<u64, String>>,
    pub(super) files: BTreeMap<String, SavedElf>,
}

impl UnwindBundle {
    pub(super) fn add_maps(&mut self, pid: u32, text: &str) {
        let lines = self.maps.entry(pid).or_default();
        for line in text.lines() {
            if let Some(m) = crate::os::maps::parse_line(line).filter(|m| m.is_exec()) {
                lines.insert(m.start, line.to_string());
            }
        }
    }

    pub(super) fn maps_text(&self, pid: u32) -> Option<String> {
        let lines = self.maps.get(&pid)?;
        Some(lines.values().map(|l| format!("{l}\n")).collect())
    }
}

/// `MAJOR:MINOR INODE`, the device as maps prints it.
pub(super) fn file_id(dev: (u32, u32), inode: u64) -> String {
    format!("{:02x}:{:02x} {inode}", dev.0, dev.1)
}

/// Where modules come from.
pub(super) enum Source {
    /// `/proc` and the files it names; `Some`: also kept for a recording.
    Live(Option<Box<UnwindBundle>>),
    /// A recording's bundle.
    Saved(Box<UnwindBundle>),
}
