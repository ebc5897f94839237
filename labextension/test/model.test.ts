import { describe, expect, it, vi } from 'vitest';

import {
  changes,
  ElasticKernel,
  formatBytes,
  formatGpuHours,
  kernelLabel,
  KernelPoller,
  culledText,
  reportSeverity,
  launcherCss,
  pickerChoice,
  Profile,
  shortLabel,
  sizeIconSvg,
  renamedKernel,
  reportSummary,
  reportText,
  resumeText,
  secondsLeft,
  statusText,
  toolbarText,
  waitingText,
  warningText
} from '../src/model';

function kernel(over: Partial<ElasticKernel> = {}): ElasticKernel {
  return {
    id: 'k1',
    name: 'python3-gpu-small',
    profile: 'small',
    state: 'running',
    execution_state: 'idle',
    owner: 'me',
    slice: { devices: ['GPU-0'] },
    activity: { gpu_utilization: 37.4, gpu_memory_mib: 2048, idle_seconds: 10, warning: null },
    resume: null,
    ...over
  };
}

describe('statusText', () => {
  it('shows size, use and the one state of a running kernel', () => {
    expect(statusText(kernel())).toBe('GPU small · 37% · 2.0 GiB · idle');
  });
  it("takes JupyterLab's live status while the kernel runs", () => {
    expect(statusText(kernel(), undefined, 'busy')).toBe('GPU small · 37% · 2.0 GiB · busy');
    expect(statusText(kernel(), undefined, 'unknown')).toBe('GPU small · 37% · 2.0 GiB · idle');
    expect(statusText(kernel({ state: 'hibernated' }), undefined, 'idle')).toBe('GPU small · hibernated');
  });
  it('says how long an idle kernel has been idle', () => {
    const k = kernel({ activity: { gpu_utilization: 0, gpu_memory_mib: 512, idle_seconds: 185 } });
    expect(statusText(k)).toBe('GPU small · 0% · 512 MiB · idle for 3 min');
  });
  it('a busy kernel is busy whatever its idle time', () => {
    const k = kernel({ execution_state: 'busy', activity: { gpu_utilization: null, gpu_memory_mib: null, idle_seconds: 900 } });
    expect(statusText(k)).toBe('GPU small · busy');
  });
  it('hibernated and hibernating show no GPU use', () => {
    expect(statusText(kernel({ state: 'hibernated' }))).toBe('GPU small · hibernated');
    expect(statusText(kernel({ state: 'hibernating' }))).toBe('GPU small · hibernating');
  });
  it('a resuming kernel shows its phase', () => {
    expect(statusText(kernel({ state: 'resuming', resume: { phase: 'restoring', restored_mib: 120.4, total_mib: 300 } }))).toBe(
      'GPU small · resuming: restoring 120 of 300 MiB'
    );
  });
  it('hides for a kernel without a GPU size, or none', () => {
    expect(statusText(kernel({ profile: null }))).toBeNull();
    expect(statusText(undefined)).toBeNull();
  });
});

describe('toolbarText', () => {
  it('says hibernated / resuming beside the circle, nothing while running', () => {
    expect(toolbarText(kernel())).toBe('');
    expect(toolbarText(kernel({ state: 'hibernated' }))).toBe('Hibernated');
    expect(toolbarText(kernel({ state: 'hibernating' }))).toBe('Hibernating…');
    expect(toolbarText(kernel({ state: 'resuming', resume: { phase: 'restoring' } }))).toBe('Resuming…');
    expect(toolbarText(kernel({ state: 'resuming', resume: { phase: 'waiting_for_slice' } }))).toBe(
      'Resuming: waiting for a GPU…'
    );
    expect(toolbarText(kernel({ state: 'hibernated', profile: null }))).toBe('');
  });
});

describe('formatBytes and formatGpuHours', () => {
  it('writes sizes without exponents', () => {
    expect(formatBytes(80)).toBe('80 B');
    expect(formatBytes(1536)).toBe('1.5 KiB');
    expect(formatBytes(300 * 2 ** 20)).toBe('300 MiB');
    expect(formatBytes(12.34 * 2 ** 30)).toBe('12.3 GiB');
    expect(formatBytes(undefined)).toBe('');
  });
  it('writes GPU time as a person reads it', () => {
    expect(formatGpuHours(0)).toBe('none yet');
    expect(formatGpuHours(0.0001)).toBe('under 1 GPU-minute');
    expect(formatGpuHours(1 / 60)).toBe('1 GPU-minute');
    expect(formatGpuHours(0.2)).toBe('12 GPU-minutes');
    expect(formatGpuHours(3.44)).toBe('3.4 GPU-hours');
  });
});

describe('kernelLabel', () => {
  it("names a kernel by its notebook, else by its id's start", () => {
    const notebooks = new Map([['abcdef12-3456', 'work/analysis.ipynb']]);
    expect(kernelLabel('abcdef12-3456', notebooks)).toBe('analysis.ipynb');
    expect(kernelLabel('99999999-0000', notebooks)).toBe('99999999');
  });
});

describe('resumeText', () => {
  it('names each phase', () => {
    expect(resumeText({ phase: 'waiting_for_slice' })).toBe('resuming: waiting for a free GPU slice');
    expect(resumeText({ phase: 'waiting_for_slice', position: 2, waiting: 3, estimate_s: null })).toBe(
      'resuming: waiting for a free GPU slice (2 of 3 in the queue)'
    );
    expect(resumeText({ phase: 'waiting_for_slice', position: 1, waiting: 1, estimate_s: 300 })).toBe(
      'resuming: waiting for a free GPU slice (1 of 1 in the queue, about 5 min)'
    );
    expect(resumeText({ phase: 'starting' })).toBe('resuming: starting the kernel');
    expect(resumeText(null)).toBe('resuming');
  });
});

describe('warnings', () => {
  it('counts the seconds left, never below zero', () => {
    expect(secondsLeft({ message: '', hibernate_at: 1010.4 }, 1000)).toBe(10);
    expect(secondsLeft({ message: '', hibernate_at: 990 }, 1000)).toBe(0);
  });
  it('the notification names the notebook and the time left', () => {
    const k = kernel({ activity: { gpu_utilization: 0, gpu_memory_mib: 0, warning: { message: 'x', hibernate_at: 1030 } } });
    expect(warningText(k, 1000, 'a.ipynb')).toBe(
      'a.ipynb: idle kernel (GPU small) will be hibernated in 30 s; its variables are saved first.'
    );
  });
  it('detects a new warning, a cancelled one, and a resume', () => {
    const warned = kernel({ activity: { gpu_utilization: 0, gpu_memory_mib: 0, warning: { message: 'x', hibernate_at: 1 } } });
    expect(changes(kernel(), warned)).toEqual({ warned: true, warningCleared: false, resumed: false, culled: false });
    expect(changes(warned, kernel())).toEqual({ warned: false, warningCleared: true, resumed: false, culled: false });
    expect(changes(warned, warned)).toEqual({ warned: false, warningCleared: false, resumed: false, culled: false });
    expect(changes(kernel({ state: 'resuming' }), kernel()).resumed).toBe(true);
    expect(changes(kernel(), kernel()).resumed).toBe(false);
  });
  it('tells a policy hibernation from one the user asked for', () => {
    const asleep = (reason: string) => kernel({ state: 'hibernated', state_reason: reason });
    expect(changes(kernel({ state: 'hibernating' }), asleep('policy')).culled).toBe(true);
    expect(changes(kernel(), asleep('policy')).culled).toBe(true);
    expect(changes(kernel({ state: 'hibernating' }), asleep('api')).culled).toBe(false);
    expect(changes(asleep('policy'), asleep('policy')).culled).toBe(false);
    expect(culledText('a.ipynb')).toBe(
      'a.ipynb: the kernel was idle, so it was hibernated to free its GPU; its variables are saved. Run a cell to bring it back.'
    );
  });
});

describe('reportText', () => {
  it('lists what was restored, recomputed, not restored and why', () => {
    const text = reportText({
      restored: ['a', 'b'],
      recomputed: [{ name: 'gen', cells: [3] }],
      not_restored: [{ name: 'f', reason: 'TextIOWrapper: cannot pickle', not_recomputed: 'the cell writes a file' }],
      differs: { m: 'an attribute was dropped' },
      refused: null
    });
    expect(text).toContain('2 variable(s) restored');
    expect(text).toContain('Restored: a, b.'); // "Details" names them, not only counts them
    expect(text).toContain('Recomputed by re-running cells: gen.');
    expect(text).toContain('Not restored: f: TextIOWrapper: cannot pickle (not recomputed: the cell writes a file).');
    expect(text).toContain('Restored with differences: m: an attribute was dropped.');
  });
  it('says when the checkpoint was refused', () => {
    expect(reportText({ refused: 'digest mismatch' })).toBe(
      'Kernel resumed empty: the checkpoint was not loaded (digest mismatch).'
    );
  });
});

describe('KernelPoller', () => {
  it('one request per poll for every kernel, and listeners see the previous state', async () => {
    const replies = [[kernel()], [kernel({ state: 'hibernated' })]];
    const fetcher = vi.fn(async () => ({ status: 200, json: async () => replies.shift() }));
    const poller = new KernelPoller(fetcher);
    const seen: string[] = [];
    poller.onUpdate((p, previous) => seen.push(`${previous.get('k1')?.state}->${p.kernels.get('k1')?.state}`));
    await poller.poll();
    await poller.poll();
    expect(fetcher).toHaveBeenCalledTimes(2);
    expect(fetcher).toHaveBeenCalledWith('api/elastic/kernels');
    expect(seen).toEqual(['undefined->running', 'running->hibernated']);
  });
  it('stops for good on a 404 (no server part) and shows nothing', async () => {
    vi.useFakeTimers();
    const fetcher = vi.fn(async () => ({ status: 404, json: async () => ({}) }));
    const poller = new KernelPoller(fetcher, 1000);
    poller.start();
    await vi.advanceTimersByTimeAsync(5000);
    expect(fetcher).toHaveBeenCalledTimes(1);
    expect(poller.available).toBe(false);
    expect(poller.kernels.size).toBe(0);
    vi.useRealTimers();
  });
  it('polls on schedule while available', async () => {
    vi.useFakeTimers();
    const fetcher = vi.fn(async () => ({ status: 200, json: async () => [] }));
    const poller = new KernelPoller(fetcher, 1000);
    poller.start();
    await vi.advanceTimersByTimeAsync(3500);
    expect(fetcher).toHaveBeenCalledTimes(4);
    poller.stop();
    vi.useRealTimers();
  });
  it('says the server is unreachable when it stops answering, and keeps polling until it does', async () => {
    const answers: (() => Promise<{ status: number; json: () => Promise<unknown> }>)[] = [
      async () => ({ status: 200, json: async () => [kernel()] }),
      async () => {
        throw new TypeError('Failed to fetch');
      },
      async () => ({ status: 502, json: async () => ({}) }),
      async () => ({ status: 200, json: async () => [kernel()] })
    ];
    const poller = new KernelPoller(() => answers.shift()!());
    const seen: boolean[] = [];
    poller.onUpdate(p => seen.push(p.reachable));
    await poller.poll();
    await poller.poll();
    expect(poller.reachable).toBe(false);
    expect(poller.kernels.get('k1')?.state).toBe('running'); // the last state, kept (and said to be old)
    await poller.poll();
    expect(poller.available).toBe(true); // not "no server part": it polls on
    await poller.poll();
    expect(seen).toEqual([true, false, true]);
  });
  it('polls faster only while a kernel resumes or hibernates', async () => {
    const poller = new KernelPoller(async () => ({ status: 200, json: async () => [] }), 3000, 1000);
    expect(poller.nextDelay()).toBe(3000);
    poller.kernels.set('k1', kernel({ state: 'resuming' }));
    expect(poller.nextDelay()).toBe(1000);
    poller.kernels.set('k1', kernel({ state: 'hibernated' }));
    expect(poller.nextDelay()).toBe(3000);
  });
});

describe('reportSeverity', () => {
  it('a full restore closes by itself; a partial one warns; an empty one is an error', () => {
    expect(reportSeverity({ restored: ['a'], not_restored: [] })).toBe('success');
    expect(reportSeverity(null)).toBe('success');
    expect(reportSeverity({ restored: ['a'], not_restored: [{ name: 'sock' }] })).toBe('warning');
    expect(reportSeverity({ refused: 'digest mismatch', restored: [] })).toBe('error');
  });
});

describe('reportSummary', () => {
  it('fits one line and names what is missing', () => {
    expect(
      reportSummary({ restored: ['a', 'b'], recomputed: [{ name: 'g' }], not_restored: [{ name: 'sock', reason: 'x' }] })
    ).toBe('Kernel resumed: 2 variable(s) restored, 1 recomputed; not restored: sock.');
    expect(reportSummary({ refused: 'bad digest' })).toBe(
      'Kernel resumed, empty: none of its variables came back (its checkpoint could not be loaded). Run your cells again to rebuild them.'
    );
  });
  it('says the new size after a resize', () => {
    expect(reportSummary({ restored: ['a', 'b', 'c'] }, 'whole')).toBe('Kernel resized to GPU whole: 3 variable(s) restored.');
    expect(reportSummary(null, 'medium')).toBe('Kernel resized to GPU medium.');
  });
});

describe('renamedKernel', () => {
  it("names the new size's kernelspec once the kernel has settled", () => {
    const resized = kernel({ name: 'python3-gpu-whole', profile: 'whole' });
    expect(renamedKernel('python3-gpu-small', resized)).toBe('python3-gpu-whole');
    expect(renamedKernel('python3-gpu-small', { ...resized, state: 'hibernated' })).toBe('python3-gpu-whole');
  });
  it('leaves the connection alone when nothing changed, mid-change, or without a size', () => {
    expect(renamedKernel('python3-gpu-small', kernel())).toBe('');
    const midway = kernel({ name: 'python3-gpu-whole', profile: 'whole', state: 'resuming' });
    expect(renamedKernel('python3-gpu-small', midway)).toBe('');
    expect(renamedKernel('python3', kernel({ name: 'python3', profile: null }))).toBe('');
    expect(renamedKernel('python3-gpu-small', undefined)).toBe('');
  });
});

describe('launcherCss', () => {
  const profiles: Profile[] = [
    { name: 'whole', display_name: 'GPU whole', gpu_fraction: 1, memory_mib: 40960, kernelspecs: ['python3-gpu-whole'] },
    { name: 'small', display_name: 'GPU small (10 GiB)', gpu_fraction: 0.25, memory_mib: 10240, kernelspecs: ['python3-gpu-small'] },
    { name: 'medium', display_name: 'GPU medium (20 GiB)', gpu_fraction: 0.5, memory_mib: 20480, kernelspecs: ['python3-gpu-medium', 'gone'] }
  ];
  const names: Record<string, string> = {
    'python3-gpu-whole': 'Python 3 · GPU whole',
    'python3-gpu-small': 'Python 3 · GPU small (10 GiB)',
    'python3-gpu-medium': 'Python 3 · GPU "medium" (20 GiB)'
  };
  const css = launcherCss(profiles, spec => names[spec]);
  it('orders the cards by GPU share, smallest first', () => {
    expect(css).toContain('.jp-LauncherCard[title="Python 3 · GPU small (10 GiB)"] { order: 1; }');
    expect(css).toContain('.jp-LauncherCard[title="Python 3 · GPU \\"medium\\" (20 GiB)"] { order: 2; }');
    expect(css).toContain('.jp-LauncherCard[title="Python 3 · GPU whole"] { order: 3; }');
    expect(css).not.toContain('gone');
  });
  it('gives each size its icon and a short label', () => {
    expect(css).toContain('content: "Python 3 · GPU small"; display: block; white-space: pre-line;');
    expect(shortLabel('Python 3 · GPU whole')).toBe('Python 3 · GPU whole');
    expect(css.match(/content: url\("data:image\/svg\+xml,/g)?.length).toBe(3);
  });
  it('says under a card when its size would wait, or never fits', () => {
    const full = launcherCss(
      [
        { ...profiles[0], fits_now: false, fits_ever: true },
        { ...profiles[1], fits_now: true, fits_ever: true },
        { ...profiles[2], fits_now: false, fits_ever: false }
      ],
      spec => names[spec],
      true
    );
    expect(full).toContain('content: "Python 3 · GPU whole\\a all taken: waits for a slice";');
    // Without a start queue, a start of a full size is refused: the card does not say it would wait.
    const refused = launcherCss([{ ...profiles[0], fits_now: false, fits_ever: true }], spec => names[spec]);
    expect(refused).toContain('content: "Python 3 · GPU whole\\a all taken now";');
    expect(full).toContain('.jp-LauncherCard[title="Python 3 · GPU whole"] { order: 3; opacity: 0.6; }');
    expect(full).toContain('\\a never fits these GPUs";');
    expect(full).toContain('.jp-LauncherCard[title="Python 3 · GPU small (10 GiB)"] { order: 1; }');
    expect(css).not.toContain('waits');
  });
  it('draws the share as a pie and the memory under it', () => {
    expect(sizeIconSvg(1, 40960)).toContain('<circle cx="26" cy="22" r="17" fill="#f57c00"/>');
    expect(sizeIconSvg(1, 40960)).toContain('>40 GiB</text>');
    expect(sizeIconSvg(0.25, 10240)).toContain('A17 17 0 0 1 43.00 22.00 Z');
    expect(sizeIconSvg(0.75, null)).toContain(' 0 1 1 ');
    expect(sizeIconSvg(0.75, null)).not.toContain('<text');
  });
});

describe('pickerChoice', () => {
  const profiles: Profile[] = [
    { name: 'small', display_name: 'GPU small', gpu_fraction: 0.25, memory_mib: 10240, kernelspecs: ['python3-gpu-small', 'ir-gpu-small'], fits_now: true },
    { name: 'medium', display_name: 'GPU medium', gpu_fraction: 0.5, memory_mib: 20480, kernelspecs: ['python3-gpu-medium'], fits_now: true },
    { name: 'whole', display_name: 'GPU whole', gpu_fraction: 1, memory_mib: null, kernelspecs: ['python3-gpu-whole'], fits_now: false },
    { name: 'huge', display_name: 'GPU huge', gpu_fraction: 4, memory_mib: null, kernelspecs: ['python3-gpu-huge'], fits_now: false, fits_ever: false }
  ];
  const specs = ['python3', 'python3-gpu-small', 'ir-gpu-small', 'python3-gpu-medium', 'python3-gpu-whole', 'python3-gpu-huge'];
  it('notes the sizes that would not start, and preselects the largest of the same kernel that fits', () => {
    const choice = pickerChoice(specs, 'python3-gpu-whole', profiles, false);
    expect(choice.notes).toEqual({ 'python3-gpu-whole': 'all taken now', 'python3-gpu-huge': 'never fits these GPUs' });
    expect(choice.select).toBe('python3-gpu-medium');
  });
  it('leaves the choice alone when it fits, when starts wait in the queue, or without a size', () => {
    expect(pickerChoice(specs, 'python3-gpu-small', profiles, false).select).toBeNull();
    const queued = pickerChoice(specs, 'python3-gpu-whole', profiles, true);
    expect(queued.select).toBeNull();
    expect(queued.notes['python3-gpu-whole']).toBe('all taken: waits for a slice');
    expect(pickerChoice(specs, 'python3', profiles, false).select).toBeNull();
    expect(pickerChoice(specs, null, profiles, false).select).toBeNull();
  });
});

describe('waitingText', () => {
  it('says where the wait stands, only while it waits for a slice', () => {
    const waiting = kernel({ state: 'resuming', resume: { phase: 'waiting_for_slice', position: 2, waiting: 3, estimate_s: 30 } });
    expect(waitingText(waiting, 'a.ipynb')).toBe(
      'a.ipynb: waiting for a free GPU slice (small) to resume the kernel (2 of 3 in the queue, about 30 s). Cancel keeps it hibernated, with its variables.'
    );
    expect(waitingText(kernel({ state: 'resuming', resume: { phase: 'restoring' } }), 'a.ipynb')).toBe('');
    expect(waitingText(kernel(), undefined)).toBe('');
  });
});
