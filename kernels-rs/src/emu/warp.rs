//! Warp collectives (`shfl.sync`, `vote.sync.ballot`, `mma.sync`) through a per-warp
//! exchange.
//!
//! Each lane that executes a collective deposits its operands in a *round* keyed by the
//! collective's mask and kind, then waits. When every lane of the mask has arrived, the
//! last one computes all lanes' results and wakes the others. As PTX requires (`.sync`
//! instructions wait for "all non-exited threads in membermask" executing "the same
//! qualifiers and the same membermask"), lanes meet only at a collective of the same kind
//! and the same mask; disjoint masks (say lanes 0–15 and 16–31 in two branches) form
//! independent rounds. Misuse is reported as [`EmuError::WarpCollective`]:
//! - a mask that does not contain the executing lane, names lanes the block does not have
//!   (the last warp of a block whose size is not a multiple of 32 is partial), or names
//!   lanes that have returned from the kernel (stricter than PTX, which would only leave
//!   the result undefined);
//! - two collectives of different kinds with the same mask waiting at once;
//! - any wait that can never complete (the block's deadlock detection, see
//!   [`super::block`]), for instance a lane of the mask waiting at `sync_threads`;
//! - `shfl_idx` reading a lane outside the mask (undefined in PTX);
//! - `mma_*` without all 32 lanes (the instructions are `.aligned`).
//!
//! Shuffle sources follow the PTX ISA pseudo-code with `c = 0x1f` (the whole warp is one
//! segment, as CUDA's `__shfl_*_sync` with the default width): the source lane operand
//! is taken modulo 32 (`b[4:0]`); `shfl_down` past lane 31 returns the lane's own value.
//! `shfl_xor`/`shfl_down` from an existing lane outside the mask is undefined in PTX too,
//! but it is the usual partial-warp reduction idiom (read, then ignore), so it returns
//! [`SHFL_UNDEFINED`] instead of failing.
//!
//! Warp collectives do not order shared memory (see [`super::smem`]).

use std::fmt;

use std::sync::Arc;

use super::block::{BlockSync, State, Status, Stop, Wakes};
use super::error::EmuError;
use super::mma::{self, MmaFragments};

/// What `shfl_xor`/`shfl_down` return when their source lane is outside the mask.
pub const SHFL_UNDEFINED: u32 = 0xA5A5_A5A5;

/// Which collective a lane executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `shfl.sync.bfly.b32`.
    ShflXor,
    /// `shfl.sync.idx.b32`.
    ShflIdx,
    /// `shfl.sync.down.b32`.
    ShflDown,
    /// `vote.sync.ballot.b32`.
    Ballot,
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`.
    MmaBf16,
    /// `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`.
    MmaE4m3,
    /// `mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale…e4m3.e4m3…ue8m0`.
    MmaMxf8,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ShflXor => "shfl_xor",
            Self::ShflIdx => "shfl_idx",
            Self::ShflDown => "shfl_down",
            Self::Ballot => "ballot",
            Self::MmaBf16 => "mma_bf16_m16n8k16",
            Self::MmaE4m3 => "mma_e4m3_m16n8k32",
            Self::MmaMxf8 => "mma_mxf8_e4m3_m16n8k32",
        })
    }
}

impl Kind {
    /// Whether this is a tensor-core MMA (which needs the full warp).
    fn is_mma(self) -> bool {
        matches!(self, Self::MmaBf16 | Self::MmaE4m3 | Self::MmaMxf8)
    }
}

/// One lane's operands.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Input {
    /// Shuffled value, or the ballot predicate (0 / 1).
    pub word: u32,
    /// Shuffle lane operand (`lane_mask`, `src_lane`, `delta`).
    pub param: u32,
    /// MMA fragments.
    pub frags: MmaFragments,
}

/// One lane's result.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Output {
    /// Shuffle or ballot result.
    pub word: u32,
    /// MMA D fragment.
    pub d: [f32; 4],
}

/// A collective some lanes of a mask have reached.
#[derive(Debug)]
pub(crate) struct Round {
    /// Unique id within the launch.
    pub id: u64,
    /// The collective.
    pub kind: Kind,
    /// Its mask.
    pub mask: u32,
    /// Lanes that have arrived.
    pub arrived: u32,
    /// Operands of the arrived lanes.
    inputs: Box<[Input; 32]>,
}

/// One warp's exchange.
#[derive(Debug)]
pub(crate) struct WarpState {
    /// Lanes that exist in the block.
    existing: u32,
    /// Lanes that have returned from the kernel.
    pub exited: u32,
    /// Rounds waiting for lanes.
    pub open: Vec<Round>,
}

impl WarpState {
    /// A warp whose existing lanes are `existing`.
    pub(crate) fn new(existing: u32) -> Self {
        Self {
            existing,
            exited: 0,
            open: Vec::new(),
        }
    }

    /// Forgets everything of the previous block.
    pub(crate) fn reset(&mut self) {
        self.exited = 0;
        self.open.clear();
    }

    /// The open round whose mask names `lane` but that `lane` has not reached.
    pub(crate) fn waiting_for(&self, lane: u32) -> Option<&Round> {
        self.open
            .iter()
            .find(|r| r.mask & !r.arrived & (1 << lane) != 0)
    }
}

/// Lanes of a mask as ranges: `0-7,9,12-15`.
pub(crate) fn describe_lanes(mask: u32) -> String {
    let mut parts = Vec::new();
    let mut lane = 0;
    while lane < 32 {
        if mask & (1 << lane) == 0 {
            lane += 1;
            continue;
        }
        let start = lane;
        while lane < 32 && mask & (1 << lane) != 0 {
            lane += 1;
        }
        parts.push(if lane - 1 == start {
            format!("{start}")
        } else {
            format!("{start}-{}", lane - 1)
        });
    }
    if parts.is_empty() {
        "(none)".to_string()
    } else {
        parts.join(",")
    }
}

impl BlockSync {
    /// Thread `thread` executes collective `kind` over `mask` with operands `input`;
    /// returns its result once all lanes of `mask` have arrived.
    pub(crate) fn collective(
        self: &Arc<Self>,
        thread: u32,
        kind: Kind,
        mask: u32,
        input: Input,
    ) -> Result<Output, Stop> {
        let arrived = {
            // (Declared first: the wake-ups happen after the state lock is released.)
            let mut wakes = Wakes::new(self);
            let mut st = self.lock();
            self.arrive(&mut st, &mut wakes, thread, kind, mask, input)?
        };
        match arrived {
            Some(mine) => Ok(mine),
            None => self.wait_released(thread, true),
        }
    }

    /// The arrival of `thread` at collective `kind`; `Ok(Some(result))` when it completed
    /// the round, `Ok(None)` when it must wait for its result.
    fn arrive(
        &self,
        st: &mut State,
        wakes: &mut Wakes<'_>,
        thread: u32,
        kind: Kind,
        mask: u32,
        input: Input,
    ) -> Result<Option<Output>, Stop> {
        let (warp, lane) = (thread / 32, thread % 32);
        let w = warp as usize;
        BlockSync::check(st)?;
        let misuse = |st: &State, detail: String| EmuError::WarpCollective {
            block: st.block,
            warp,
            detail,
        };
        if let Some(detail) = arrival_problem(&st.warps[w], st.block_dim, lane, kind, mask) {
            let err = misuse(st, detail);
            return Err(self.fail(st, err));
        }

        // Join the round of this mask, or open it.
        let next_id = st.next_round;
        let ws = &mut st.warps[w];
        let idx = match ws.open.iter().position(|r| r.mask == mask) {
            Some(i) => i,
            None => {
                ws.open.push(Round {
                    id: next_id,
                    kind,
                    mask,
                    arrived: 0,
                    inputs: Box::new([Input::default(); 32]),
                });
                ws.open.len() - 1
            }
        };
        let round = &mut ws.open[idx];
        round.arrived |= 1 << lane;
        round.inputs[lane as usize] = input;
        let (id, complete) = (round.id, round.arrived == mask);
        if id == next_id {
            st.next_round += 1;
        }

        if complete {
            // Last to arrive: compute everyone's result and release the others.
            let round = st.warps[w].open.swap_remove(idx);
            if let Some(t) = &self.tracer {
                let counter = match round.kind {
                    Kind::MmaBf16 => &t.mma_bf16,
                    Kind::MmaE4m3 => &t.mma_e4m3,
                    Kind::MmaMxf8 => &t.mma_mxf8,
                    Kind::Ballot => &t.ballots,
                    _ => &t.shuffles,
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let outputs = match compute(&round) {
                Ok(outputs) => outputs,
                Err(detail) => {
                    let err = misuse(st, detail);
                    return Err(self.fail(st, err));
                }
            };
            let others = mask & !(1 << lane);
            for l in (0..32).filter(|l| others & (1 << l) != 0) {
                self.release(st, warp * 32 + l, Some(outputs[l as usize]));
            }
            self.schedule(st, wakes);
            return Ok(Some(outputs[lane as usize]));
        }

        self.block_thread(st, thread, Status::InCollective(id), wakes);
        Ok(None)
    }
}

/// Why lane `lane` of warp `ws` (in a block of `block_dim` threads) may not execute
/// collective `kind` over `mask` now, if it may not.
fn arrival_problem(
    ws: &WarpState,
    block_dim: u32,
    lane: u32,
    kind: Kind,
    mask: u32,
) -> Option<String> {
    if mask & (1 << lane) == 0 {
        return Some(format!(
            "lane {lane} executes {kind} with mask {mask:#010x}, which does not contain it"
        ));
    }
    if kind.is_mma() && (mask != u32::MAX || ws.existing != u32::MAX) {
        return Some(format!(
            "{kind} needs all 32 lanes of the warp, but the mask is {mask:#010x} and the \
             block has lanes {} of this warp",
            describe_lanes(ws.existing)
        ));
    }
    if mask & !ws.existing != 0 {
        return Some(format!(
            "lane {lane} executes {kind} with mask {mask:#010x}, which names lanes {} that \
             the block does not have (it has {block_dim} threads)",
            describe_lanes(mask & !ws.existing)
        ));
    }
    if mask & ws.exited != 0 {
        return Some(format!(
            "lane {lane} executes {kind} with mask {mask:#010x}, which names lanes {} that \
             have returned from the kernel",
            describe_lanes(mask & ws.exited)
        ));
    }
    let other = ws.open.iter().find(|r| r.mask == mask && r.kind != kind)?;
    Some(format!(
        "lanes {} wait in {} with mask {mask:#010x} while lane {lane} executes {kind} with \
         the same mask",
        describe_lanes(other.arrived),
        other.kind
    ))
}

/// All lanes' results of a complete round, or what made it undefined.
fn compute(round: &Round) -> Result<Box<[Output; 32]>, String> {
    let mut out = Box::new([Output::default(); 32]);
    let mask = round.mask;
    let member = |l: u32| mask & (1 << l) != 0;
    match round.kind {
        Kind::ShflXor | Kind::ShflIdx | Kind::ShflDown => {
            for lane in (0..32u32).filter(|&l| member(l)) {
                let b = round.inputs[lane as usize].param & 31;
                let src = match round.kind {
                    Kind::ShflXor => lane ^ b,
                    Kind::ShflIdx => b,
                    _ if lane + b > 31 => lane,
                    _ => lane + b,
                };
                out[lane as usize].word = if member(src) {
                    round.inputs[src as usize].word
                } else if round.kind == Kind::ShflIdx {
                    return Err(format!(
                        "lane {lane} executes shfl_idx from lane {src} (operand {}), outside \
                         the mask {mask:#010x}: undefined in PTX",
                        round.inputs[lane as usize].param
                    ));
                } else {
                    SHFL_UNDEFINED
                };
            }
        }
        Kind::Ballot => {
            let bits = (0..32u32)
                .filter(|&l| member(l) && round.inputs[l as usize].word != 0)
                .fold(0u32, |acc, l| acc | 1 << l);
            for lane in (0..32u32).filter(|&l| member(l)) {
                out[lane as usize].word = bits;
            }
        }
        Kind::MmaBf16 | Kind::MmaE4m3 | Kind::MmaMxf8 => {
            let frags: [MmaFragments; 32] = std::array::from_fn(|l| round.inputs[l].frags);
            let d = match round.kind {
                Kind::MmaBf16 => mma::mma_bf16_m16n8k16(&frags),
                Kind::MmaE4m3 => mma::mma_e4m3_m16n8k32(&frags),
                _ => mma::mma_mxf8_e4m3_m16n8k32(&frags),
            };
            for (o, d) in out.iter_mut().zip(d) {
                o.d = d;
            }
        }
    }
    Ok(out)
}
