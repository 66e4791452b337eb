//! The slow path: frames framehop cannot unwind (CFA expressions that read
//! memory), evaluated with gimli from the copied stack window.

use super::*;

// ---- Slow path: frames framehop cannot unwind, evaluated with gimli --------
//
// framehop turns each CFI row into a cached rule (CFA = rsp/rbp + offset,
// rbp and return address at CFA + offset). Rows it cannot turn into such a
// rule it evaluates once per frame, but without memory reads and knowing only
// rsp, rbp and rip; when that fails it silently uses the frame-pointer rule,
// which in a function whose rbp is an ordinary register produces garbage (and
// caches that rule). Hand-written assembly (OpenSSL's SHA, AES, bignum code:
// `DW_CFA_def_cfa_expression (DW_OP_breg7 (rsp): 152; DW_OP_deref;
// DW_OP_plus_uconst: 8)` after realigning the stack), GCC's stack-realigning
// prologues and glibc's signal trampoline have such rows.
//
// So every FDE with a rule framehop would get wrong (CFA from an expression or
// from a register other than rsp/rbp, rbp or the return address from an
// expression) is listed per file, and frames in those FDEs are unwound here
// instead: gimli computes the row, expressions are evaluated with rsp, rbp and
// rip (other registers: give up) and memory reads served from the copied
// stack window. Other frames cost one binary search in an (almost always
// empty) list.

pub(super) type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// Error for a frame the slow path cannot unwind (ends the walk as Failed).
pub(super) const SLOW_FAILED: FhError = FhError::DidNotAdvance;

/// Most operations evaluated in one DWARF expression.
pub(super) const MAX_EXPR_STEPS: u32 = 256;

/// Most CFI entries scanned in one file for [`SlowFdes`].
pub(super) const MAX_SCANNED_ENTRIES: usize = 1 << 22;

/// Bytes above `sp` searched by [`saved_sp_scan`].
pub(super) const SAVED_SP_SCAN: u64 = 8192;

/// One module's CFI section, as gimli reads it.
pub(super) enum CfiSection<'a> {
    Eh(EhFrame<Slice<'a>>),
    Debug(DebugFrame<Slice<'a>>),
}

/// The FDEs of one file that framehop cannot evaluate.
#[derive(Default)]
pub(super) struct SlowFdes {
    /// `(start SVMA, end SVMA, FDE offset in the section)`, sorted by start.
    pub(super) fdes: Vec<(u64, u64, usize)>,
}

impl SlowFdes {
    pub(super) fn scan<'d, S: UnwindSection<Slice<'d>>>(
        section: &S,
        bases: &BaseAddresses,
    ) -> Self {
        let mut fdes = Vec::new();
        let mut cie_slow: HashMap<usize, bool> = HashMap::new();
        let mut last_cie: Option<gimli::CommonInformationEntry<Slice<'d>>> = None;
        let mut entries = section.entries(bases);
        for _ in 0..MAX_SCANNED_ENTRIES {
            let partial = match entries.next() {
                Ok(Some(CieOrFde::Fde(p))) => p,
                Ok(Some(CieOrFde::Cie(_))) => continue,
                Ok(None) | Err(_) => break,
            };
            let fde = partial.parse(|section: &S, bases, offset| {
                if let Some(c) = &last_cie
                    && c.offset() == <S::Offset as gimli::UnwindOffset<usize>>::into(offset)
                {
                    return Ok(c.clone());
                }
                let c = section.cie_from_offset(bases, offset)?;
                last_cie = Some(c.clone());
                Ok(c)
            });
            let Ok(fde) = fde else { continue };
            let cie = fde.cie();
            let slow = *cie_slow
                .entry(cie.offset())
                .or_insert_with(|| needs_slow_path(cie.instructions(section, bases)))
                || needs_slow_path(fde.instructions(section, bases));
            if slow && fde.len() > 0 {
                let start = fde.initial_address();
                fdes.push((start, start.saturating_add(fde.len()), fde.offset()));
            }
        }
        fdes.sort_unstable_by_key(|f| f.0);
        SlowFdes { fdes }
    }

    /// The FDE offset covering `svma`, if that FDE needs the slow path.
    #[inline]
    pub(super) fn find(&self, svma: u64) -> Option<usize> {
        if self.fdes.is_empty() {
            return None;
        }
        let i = self.fdes.partition_point(|f| f.0 <= svma).checked_sub(1)?;
        let (_, end, offset) = self.fdes[i];
        (svma < end).then_some(offset)
    }
}

/// Whether CFI instructions set a rule framehop cannot evaluate.
pub(super) fn needs_slow_path(mut insns: gimli::CallFrameInstructionIter<'_, Slice<'_>>) -> bool {
    let plain_cfa = |r: Register| r == X86_64::RSP || r == X86_64::RBP;
    let used = |r: Register| r == X86_64::RBP || r == X86_64::RA;
    while let Ok(Some(insn)) = insns.next() {
        match insn {
            CallFrameInstruction::DefCfaExpression { .. } => return true,
            CallFrameInstruction::DefCfa { register, .. }
            | CallFrameInstruction::DefCfaSf { register, .. }
            | CallFrameInstruction::DefCfaRegister { register }
                if !plain_cfa(register) =>
            {
                return true;
            }
            CallFrameInstruction::Expression { register, .. }
            | CallFrameInstruction::ValExpression { register, .. }
                if used(register) =>
            {
                return true;
            }
            _ => {}
        }
    }
    false
}

/// A process mapping's file (for its CFI) and load bias (AVMA - SVMA).
#[derive(Clone)]
pub(super) struct ModuleCfi {
    pub(super) info: Arc<ElfUnwindInfo>,
    pub(super) bias: u64,
}

impl PartialEq for ModuleCfi {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.info, &other.info) && self.bias == other.bias
    }
}

impl Eq for ModuleCfi {}

impl std::fmt::Debug for ModuleCfi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModuleCfi {{ bias: {:#x} }}", self.bias)
    }
}

impl ModuleCfi {
    /// The slow-path FDE covering `addr`, if any.
    #[inline]
    pub(super) fn slow_fde(&self, addr: u64) -> Option<usize> {
        self.info.slow_fdes().find(addr.wrapping_sub(self.bias))
    }
}

/// The copied stack: the bytes at `[start, start + bytes.len())`.
#[derive(Clone, Copy)]
pub(super) struct Window<'a> {
    pub(super) start: u64,
    pub(super) bytes: &'a [u8],
}

impl<'a> Window<'a> {
    pub(super) fn new(sp: u64, stack: &'a [u8]) -> Self {
        // Clamp so that start + len cannot overflow.
        let len = (stack.len() as u64).min(u64::MAX - sp) as usize;
        Window {
            start: sp,
            bytes: &stack[..len],
        }
    }

    pub(super) fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    /// Little-endian value of `size` (1..=8) bytes at `addr`.
    #[inline]
    pub(super) fn read(&self, addr: u64, size: usize) -> Option<u64> {
        if size == 0 || size > 8 {
            return None;
        }
        let off = usize::try_from(addr.checked_sub(self.start)?).ok()?;
        let src = self.bytes.get(off..off.checked_add(size)?)?;
        let mut word = [0u8; 8];
        word[..size].copy_from_slice(src);
        Some(u64::from_le_bytes(word))
    }
}

/// Value of a register in a frame, where known.
pub(super) fn reg_value(regs: &UnwindRegsX86_64, r: Register) -> Option<u64> {
    match r {
        X86_64::RSP => Some(regs.sp()),
        X86_64::RBP => Some(regs.bp()),
        X86_64::RA => Some(regs.ip()),
        _ => None,
    }
}

pub(super) enum ExprError {
    /// Needed the stack at this address, outside the window.
    Read(u64),
    /// An unknown register, an unsupported operation, a malformed expression.
    Unsupported,
}

impl ExprError {
    pub(super) fn into_fh(self) -> FhError {
        match self {
            ExprError::Read(a) => FhError::CouldNotReadStack(a),
            ExprError::Unsupported => SLOW_FAILED,
        }
    }
}

/// Evaluate a CFI expression (`initial`: the CFA, pushed first for register
/// rules) to the address or value it computes.
pub(super) fn eval_expr(
    expr: Expression<Slice<'_>>,
    encoding: gimli::Encoding,
    regs: &UnwindRegsX86_64,
    win: Window<'_>,
    initial: Option<u64>,
) -> Result<u64, ExprError> {
    let mut eval = Evaluation::new(expr.0, encoding);
    eval.set_max_iterations(MAX_EXPR_STEPS);
    if let Some(v) = initial {
        eval.set_initial_value(v);
    }
    let generic = UnitOffset(0);
    let mut step = eval.evaluate();
    loop {
        step = match step.map_err(|_| ExprError::Unsupported)? {
            EvaluationResult::Complete => break,
            EvaluationResult::RequiresRegister {
                register,
                base_type,
            } if base_type == generic => {
                let v = reg_value(regs, register).ok_or(ExprError::Unsupported)?;
                eval.resume_with_register(Value::Generic(v))
            }
            EvaluationResult::RequiresMemory {
                address,
                size,
                space: None,
                base_type,
            } if base_type == generic => {
                let v = win
                    .read(address, size as usize)
                    .ok_or(ExprError::Read(address))?;
                eval.resume_with_memory(Value::Generic(v))
            }
            _ => return Err(ExprError::Unsupported),
        };
    }
    match eval.as_result() {
        [
            gimli::Piece {
                location: Location::Address { address },
                ..
            },
        ] => Ok(*address),
        [
            gimli::Piece {
                location: Location::Value { value },
                ..
            },
        ] => value.to_u64(u64::MAX).map_err(|_| ExprError::Unsupported),
        _ => Err(ExprError::Unsupported),
    }
}

/// The CFA of a frame whose rule `DW_OP_breg7 (rsp): N; DW_OP_deref;
/// DW_OP_plus_uconst: M` with N < 0 reads the saved entry stack pointer from
/// the red zone below `sp`, which the window does not hold. OpenSSL's AVX2 SHA
/// loops do this over most of their body (`push 0x78(%rsp); lea 8(%rsp),
/// %rsp` moves a copy of it down with the stack), but the original copy (and
/// earlier ones) stay above `sp`. So take the first 8-byte slot above `sp`
/// holding a value V that points above the slot into the window such that
/// `accept(V + M)` (the caller's frame that CFA gives looks right); then
/// CFA = V + M. Stale copies from earlier calls are why `accept` checks.
pub(super) fn saved_sp_scan(
    expr: Expression<Slice<'_>>,
    win: Window<'_>,
    accept: &mut dyn FnMut(u64) -> bool,
) -> Option<u64> {
    let mut r = expr.0;
    let op = |r: &mut Slice<'_>, want: gimli::DwOp| r.read_u8().ok() == Some(want.0);
    if !op(&mut r, gimli::DW_OP_breg7) || r.read_sleb128().ok()? >= 0 {
        return None;
    }
    if !op(&mut r, gimli::DW_OP_deref) || !op(&mut r, gimli::DW_OP_plus_uconst) {
        return None;
    }
    let m = r.read_uleb128().ok()?;
    if !r.is_empty() {
        return None;
    }
    let scan_end = win.end().min(win.start.saturating_add(SAVED_SP_SCAN));
    let mut slot = win.start;
    while slot.checked_add(8).is_some_and(|e| e <= scan_end) {
        let v = win.read(slot, 8)?;
        if v > slot
            && v % 8 == 0
            && let Some(cfa) = v.checked_add(m).filter(|&c| accept(c))
        {
            return Some(cfa);
        }
        slot += 8;
    }
    None
}

/// Unwind the frame at `lookup` (the ip for the first frame, the return
/// address minus 1 after) from its CFI row in the slow-path FDE at
/// `fde_offset`, setting `regs` to the caller's. `Ok(None)`: the outermost
/// frame (no return address). `plausible` tells whether caller registers look
/// right (used only where the CFA has to be guessed, see [`saved_sp_scan`]).
pub(super) fn slow_step(
    cfi: &ModuleCfi,
    fde_offset: usize,
    lookup: u64,
    regs: &mut UnwindRegsX86_64,
    ctx: &mut UnwindContext<usize>,
    win: Window<'_>,
    plausible: &mut dyn FnMut(&UnwindRegsX86_64) -> bool,
) -> Result<Option<u64>, FhError> {
    let (section, bases) = cfi.info.cfi().ok_or(SLOW_FAILED)?;
    let svma = lookup.wrapping_sub(cfi.bias);
    match section {
        CfiSection::Eh(s) => slow_step_in(&s, &bases, fde_offset, svma, regs, ctx, win, plausible),
        CfiSection::Debug(s) => {
            slow_step_in(&s, &bases, fde_offset, svma, regs, ctx, win, plausible)
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn slow_step_in<'d, S: UnwindSection<Slice<'d>>>(
    section: &S,
    bases: &BaseAddresses,
    fde_offset: usize,
    svma: u64,
    regs: &mut UnwindRegsX86_64,
    ctx: &mut UnwindContext<usize>,
    win: Window<'_>,
    plausible: &mut dyn FnMut(&UnwindRegsX86_64) -> bool,
) -> Result<Option<u64>, FhError> {
    let fde = section
        .fde_from_offset(bases, S::Offset::from(fde_offset), S::cie_from_offset)
        .map_err(|_| SLOW_FAILED)?;
    let encoding = fde.cie().encoding();
    let row = fde
        .unwind_info_for_address(section, bases, ctx, svma)
        .map_err(|_| SLOW_FAILED)?;
    let cfa_rule = row.cfa().clone();
    let bp_rule = row.register(X86_64::RBP);
    let ra_rule = row.register(X86_64::RA);
    let cur = *regs;

    // Caller registers for a CFA; `Ok(None)`: no return address (outermost).
    let caller = |cfa: u64| -> Result<Option<UnwindRegsX86_64>, FhError> {
        // The return address sits at or above CFA - 8 >= sp.
        if cfa <= cur.sp() {
            return Err(SLOW_FAILED);
        }
        let ra = match &ra_rule {
            None | Some(RegisterRule::Undefined) => return Ok(None),
            Some(rule) => {
                eval_rule(section, rule.clone(), cfa, encoding, &cur, win)?.ok_or(SLOW_FAILED)?
            }
        };
        // As framehop: rbp we cannot recover keeps its value.
        let bp = match &bp_rule {
            Some(rule) => eval_rule(section, rule.clone(), cfa, encoding, &cur, win)
                .ok()
                .flatten()
                .unwrap_or(cur.bp()),
            None => cur.bp(),
        };
        Ok(Some(UnwindRegsX86_64::new(ra, cfa, bp)))
    };

    let cfa = match cfa_rule {
        CfaRule::RegisterAndOffset { register, offset } => reg_value(&cur, register)
            .and_then(|v| v.checked_add_signed(offset))
            .ok_or(SLOW_FAILED)?,
        CfaRule::Expression(e) => {
            let expr = e.get(section).map_err(|_| SLOW_FAILED)?;
            match eval_expr(expr, encoding, &cur, win, None) {
                Ok(cfa) => cfa,
                Err(ExprError::Read(a)) if a < win.start => {
                    let mut accept = |cfa: u64| matches!(caller(cfa), Ok(Some(c)) if c.ip() != 0 && plausible(&c));
                    saved_sp_scan(expr, win, &mut accept).ok_or(FhError::CouldNotReadStack(a))?
                }
                Err(e) => return Err(e.into_fh()),
            }
        }
    };
    let Some(next) = caller(cfa)? else {
        return Ok(None);
    };
    *regs = next;
    Ok(Some(next.ip()))
}

/// A register's value in the caller under `rule`; `Ok(None)`: unchanged or
/// undefined.
pub(super) fn eval_rule<'d, S: UnwindSection<Slice<'d>>>(
    section: &S,
    rule: RegisterRule<usize>,
    cfa: u64,
    encoding: gimli::Encoding,
    regs: &UnwindRegsX86_64,
    win: Window<'_>,
) -> Result<Option<u64>, FhError> {
    let read = |a: u64| win.read(a, 8).ok_or(FhError::CouldNotReadStack(a));
    let expr = |e: &gimli::UnwindExpression<usize>| -> Result<u64, FhError> {
        let e = e.get(section).map_err(|_| SLOW_FAILED)?;
        eval_expr(e, encoding, regs, win, Some(cfa)).map_err(ExprError::into_fh)
    };
    let at = |o: i64| cfa.checked_add_signed(o).ok_or(SLOW_FAILED);
    Ok(Some(match rule {
        RegisterRule::Undefined | RegisterRule::SameValue => return Ok(None),
        RegisterRule::Offset(o) => read(at(o)?)?,
        RegisterRule::ValOffset(o) => at(o)?,
        RegisterRule::Register(r) => reg_value(regs, r).ok_or(SLOW_FAILED)?,
        RegisterRule::Expression(e) => read(expr(&e)?)?,
        RegisterRule::ValExpression(e) => expr(&e)?,
        _ => return Err(SLOW_FAILED),
    }))
}
