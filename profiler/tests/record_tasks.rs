//! Issue 11 item 3, root integration tests: asyncio task identity on the
//! host's CPythons. tests/victims/py_tasks.py runs an asyncio server whose
//! per-connection tasks (asyncio's default names, from start_server), a
//! task named with create_task(name=...) and awaited batch tasks block the
//! loop; it logs the running task's name with every block. Each stall must
//! carry that name (at least 90% of them, and never a wrong one) and its
//! coroutine in stalls.json, and the summary's culprit line says the task
//! (pyrecord `check_tasks`); with the dict stallprof reads replaced, no
//! stall names a task, each is counted and the summary says why
//! (`check_tasks_unreadable`). The container sandbox's 3.13-3.15 (3.14+:
//! the await chain too) are in record_container.rs.
//!
//! Needs root (see tests/common/mod.rs for STALLPROF_SKIP_ROOT_TESTS).

mod common;
mod pyrecord;

use pyrecord::*;

#[test]
fn tasks_pyenv_3_10() {
    check_tasks("tasks_pyenv_3_10", found_python(10));
}

#[test]
fn tasks_pyenv_3_11() {
    check_tasks("tasks_pyenv_3_11", found_python(11));
}

#[test]
fn tasks_debian_3_11() {
    check_tasks("tasks_debian_3_11", debian_python());
}

#[test]
fn tasks_pyenv_3_12() {
    check_tasks("tasks_pyenv_3_12", found_python(12));
}

#[test]
fn tasks_pyenv_3_13() {
    check_tasks("tasks_pyenv_3_13", found_python(13));
}

#[test]
fn tasks_unreadable_are_counted_and_said_3_12() {
    check_tasks_unreadable("tasks_unreadable_3_12", found_python(12));
}
