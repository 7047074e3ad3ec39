/* A worker born straight into its cgroup v2 leaf: clone3(CLONE_INTO_CGROUP).
 *
 * cgroup v2 moves whole processes, so the daemon cannot step one thread into a worker's
 * limited node to fork it there (the v1 forker's way, _forker.py): it would stand there
 * itself, all its threads counted against pids.max and its leader an OOM candidate of the
 * worker's memory.max. Linux 5.7's clone3 places the child in the cgroup an fd names from
 * its first instruction; Python offers no clone3, glibc 2.36 no posix_spawnattr_setcgroup_np
 * (2.41), and a raw clone through ctypes would run Python in the child. So this: one call,
 * all its memory made ready before the clone, the child running only system calls.
 *
 * The flags: CLONE_INTO_CGROUP, the leaf; CLONE_VFORK, the caller waits until the child's
 * exec (or exit), so exec errors come back as this call's own; CLONE_PIDFD, a pidfd of the
 * child. Never CLONE_VM: the child, in a memory-limited cgroup from its first instruction,
 * has a copy of the daemon's memory, never the daemon's own, so an OOM kill there in the
 * microseconds before its exec reaps the copy, never the daemon's mm.
 *
 * The child, a copy of a threaded process, calls nothing that takes a lock (no malloc, no
 * stdio, no Python): signals reset (every caught one to its default: the daemon's handlers
 * would write to the daemon's wakeup fd; SIGPIPE and SIGXFSZ too, which Python ignores),
 * its mask emptied, a process group of its own, the three fds given as 0, 1 and 2, every
 * other one closed at the exec, its working directory, execve. A failure is written to a
 * close-on-exec pipe as (errno, step) and the child exits 127; the caller reaps it and
 * raises OSError.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

/* The clone_args of Linux 5.7 (CLONE_ARGS_SIZE_VER2), spelt out: older headers lack
 * its `cgroup` member. */
struct clone_args_v2 {
    uint64_t flags;
    uint64_t pidfd;
    uint64_t child_tid;
    uint64_t parent_tid;
    uint64_t exit_signal;
    uint64_t stack;
    uint64_t stack_size;
    uint64_t tls;
    uint64_t set_tid;
    uint64_t set_tid_size;
    uint64_t cgroup;
};

/* The step that failed, for the error's message. */
enum { STEP_SIGNALS = 1, STEP_PGROUP, STEP_FDS, STEP_CHDIR, STEP_EXEC };
static const char *const STEPS[] = {"", "signals", "setpgid", "fds", "chdir", "exec"};

static void fail(int pipe_w, int step) {
    int report[2] = {errno, step};
    ssize_t ignored = write(pipe_w, report, sizeof report);
    (void)ignored;
    _exit(127);
}

/* In the child: system calls only, then the exec. */
static void child(int pipe_w, int in, int out, int err, const char *cwd, const char *path,
                  char *const argv[], char *const envp[]) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction now;
        if (sigaction(sig, NULL, &now) != 0)
            continue; /* one glibc keeps for itself (32, 33) */
        if (now.sa_handler == SIG_IGN && sig != SIGPIPE && sig != SIGXFSZ)
            continue; /* an ignored signal stays ignored across an exec, as Popen leaves it */
        if (now.sa_handler != SIG_DFL)
            sigaction(sig, &dfl, NULL);
    }
    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) != 0)
        fail(pipe_w, STEP_SIGNALS);
    if (setpgid(0, 0) != 0)
        fail(pipe_w, STEP_PGROUP);
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
        fail(pipe_w, STEP_FDS);
    /* Every fd from 3 on closed at the exec; the error pipe is open until then. */
    if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
        for (int fd = 3; fd < 65536; fd++)
            if (fd != pipe_w)
                close(fd);
    }
    if (chdir(cwd) != 0)
        fail(pipe_w, STEP_CHDIR);
    execve(path, argv, envp);
    fail(pipe_w, STEP_EXEC);
}

/* A NULL-ended array of the bytes in `seq` (pointers into its items, which the caller
 * keeps alive); NULL with an exception set. */
static char **strings(PyObject *seq, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        char *text;
        Py_ssize_t size;
        if (!PyBytes_Check(item) || PyBytes_AsStringAndSize(item, &text, &size) < 0 ||
            (Py_ssize_t)strlen(text) != size) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: bytes without a NUL, each", what);
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
        out[i] = text;
    }
    Py_DECREF(fast); /* the items are the caller's list's, alive until it returns */
    return out;
}

static PyObject *spawn_into(PyObject *self, PyObject *args) {
    int cgroup_fd, in, out, err;
    const char *path, *cwd;
    PyObject *argv_obj, *envp_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "iyO!O!yiii", &cgroup_fd, &path, &PyList_Type, &argv_obj,
                          &PyList_Type, &envp_obj, &cwd, &in, &out, &err))
        return NULL;
    if (in < 3 || out < 3 || err < 3) {
        PyErr_SetString(PyExc_ValueError, "the worker's fds must each be 3 or more");
        return NULL;
    }
    if (PyList_GET_SIZE(argv_obj) == 0) {
        PyErr_SetString(PyExc_ValueError, "argv is empty");
        return NULL;
    }
    char **argv = strings(argv_obj, "argv");
    if (argv == NULL)
        return NULL;
    char **envp = strings(envp_obj, "env");
    if (envp == NULL) {
        PyMem_Free(argv);
        return NULL;
    }
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
        PyMem_Free(argv);
        PyMem_Free(envp);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int pidfd = -1;
    struct clone_args_v2 clone_args;
    memset(&clone_args, 0, sizeof clone_args);
    clone_args.flags = CLONE_INTO_CGROUP | CLONE_VFORK | CLONE_PIDFD;
    clone_args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    clone_args.exit_signal = SIGCHLD;
    clone_args.cgroup = (uint64_t)cgroup_fd;

    long pid;
    int clone_errno = 0, report[2] = {0, 0};
    ssize_t got;
    sigset_t all, old_mask;
    Py_BEGIN_ALLOW_THREADS
    /* No handler of the daemon's may run in the child before it resets them. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_mask);
    pid = syscall(SYS_clone3, &clone_args, sizeof clone_args);
    if (pid == 0)
        child(pipe_fds[1], in, out, err, cwd, path, argv, envp);
    clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    close(pipe_fds[1]);
    got = 0;
    if (pid > 0) {
        do {
            got = read(pipe_fds[0], report, sizeof report);
        } while (got < 0 && errno == EINTR);
        if (got > 0) {
            int status;
            while (waitpid((pid_t)pid, &status, 0) < 0 && errno == EINTR) {
            }
        }
    }
    close(pipe_fds[0]);
    Py_END_ALLOW_THREADS
    PyMem_Free(argv);
    PyMem_Free(envp);
    if (pid < 0) {
        errno = clone_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (got > 0) {
        if (pidfd >= 0)
            close(pidfd);
        int step = report[1] >= 1 && report[1] <= STEP_EXEC ? report[1] : 0;
        PyObject *exc_args = Py_BuildValue("(iss)", report[0], strerror(report[0]), STEPS[step]);
        if (exc_args != NULL) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
        return NULL;
    }
    return Py_BuildValue("(li)", pid, pidfd);
}

static PyMethodDef methods[] = {
    {"spawn_into", spawn_into, METH_VARARGS,
     "spawn_into(cgroup_fd, path, argv, envp, cwd, stdin, stdout, stderr) -> (pid, pidfd)\n\n"
     "Start `path` with `argv` and `envp` (lists of bytes) in `cwd`, born in the cgroup v2\n"
     "`cgroup_fd` names, in a process group of its own, its 0, 1 and 2 the fds given (each\n"
     "3 or more) and no other fd. OSError(errno, strerror, step) if a step or the exec\n"
     "failed (the child reaped), or if the clone did (EBUSY: a cgroup passing controllers\n"
     "on; ENOSYS/E2BIG: no clone3 with a cgroup, Linux before 5.7)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_clone3", "clone3(CLONE_INTO_CGROUP) for a worker's birth.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__clone3(void) { return PyModule_Create(&module); }
