//! Per-thread working buffers that outlive a call: an op's tasks borrow their thread's set
//! instead of allocating (and zero-filling, and page-faulting) one per rayon job split —
//! `for_each_init` makes a new set for every split, which at decode sizes (a few dozen
//! tasks) costs as much as the arithmetic. A set grows to the largest call its thread has
//! run and is kept for the thread's life; its contents carry nothing from one task to the
//! next (every task sizes and resets what it reads).

use std::cell::RefCell;
use std::thread::LocalKey;

/// Runs `f` with this thread's set in `key`, or with a fresh default set when the thread's
/// one is already borrowed (an op called from inside another op's task on the same thread).
pub(crate) fn with<S: Default + 'static, R>(
    key: &'static LocalKey<RefCell<S>>,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut set) => f(&mut set),
        Err(_) => f(&mut S::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SET: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    #[test]
    fn the_set_is_reused_and_nesting_gets_a_fresh_one() {
        with(&SET, |v| v.extend([1, 2, 3]));
        let (outer, inner) = with(&SET, |v| {
            let inner = with(&SET, |w| {
                w.push(9);
                w.clone()
            });
            (v.clone(), inner)
        });
        assert_eq!(outer, [1, 2, 3]);
        assert_eq!(inner, [9]);
        assert_eq!(with(&SET, |v| v.len()), 3);
    }
}
