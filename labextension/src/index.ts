/**
 * JupyterLab view of jupyter-elastic-kernels: a status bar item for the current notebook's
 * kernel (GPU size, use, state, resume progress), idle warnings as notifications with a
 * "Keep running" action, the restore report as a note, and a GPUs panel in the left sidebar.
 *
 * All data comes from one shared poll of `/api/elastic/kernels` (see KernelPoller); a server
 * without the extension's server part answers 404 and nothing appears.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, ICommandPalette, InputDialog, Notification, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { KernelMessage, ServerConnection } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { GpusPanel } from './panel';
import {
  changes,
  ElasticKernel,
  Fetcher,
  KernelPoller,
  launcherCss,
  pickerChoice,
  Profile,
  culledText,
  reportSeverity,
  renamedKernel,
  reportSummary,
  reportText,
  RestoreReport,
  sizeChoices,
  STATUS_DEFAULTS,
  StatusOptions,
  statusText,
  toolbarText,
  waitingText,
  warningText
} from './model';

const settings = ServerConnection.makeSettings();
/** The status item and toolbar while the server does not answer: the last state is not shown as now. */
const UNREACHABLE = 'server unreachable';
/** Sent on each kernel connection: this page shows the platform's notes (idle warnings, the
 * restore report) as notifications, so the server leaves them out of the notebook, which would save
 * them with the user's work (kernelmgr/checkpoint/notes.py). */
const NOTES_SHOWN_REQUEST = 'elastic_notes_shown_request';
/** A policy hibernation's notification closes by itself (it asks nothing); it stays in the
 * notification centre, and the status item says "hibernated" meanwhile. */
const CULLED_NOTICE_MS = 15000;

/** fetch() under the server's base URL with Jupyter's auth (token, XSRF). */
export const serverFetch: Fetcher = async (path, init) => {
  const url = URLExt.join(settings.baseUrl, path);
  return ServerConnection.makeRequest(url, { method: init?.method ?? 'GET', body: init?.body }, settings);
};

/** The restore report in full, in a dialog a person can read at leisure. */
async function showReport(
  notebook: string | undefined,
  report: RestoreReport | null,
  neverResumed = false
): Promise<void> {
  const body = document.createElement('pre');
  body.className = 'jp-ElasticReport';
  body.textContent = neverResumed ? 'This kernel has not been resumed from a checkpoint yet.' : reportText(report);
  await showDialog({
    title: `Restore report${notebook ? ' · ' + notebook : ''}`,
    body: new Widget({ node: body }),
    buttons: [Dialog.okButton({ label: 'Close' })]
  });
}

/**
 * The notebook toolbar's word beside the kernel's circle: "Hibernated", "Resuming…" (the circle
 * itself only knows idle and busy, and looks idle while the kernel is hibernated).
 */
class ToolbarState extends Widget {
  constructor() {
    super({ node: document.createElement('span') });
    this.addClass('jp-ElasticToolbarState');
    this.node.title = 'State of this notebook\'s elastic kernel (jupyter-elastic-kernels)';
    this.hide();
  }

  show_(text: string, state: string): void {
    this.node.textContent = text;
    this.node.dataset.state = state;
    this.setHidden(!text);
  }
}

/**
 * JupyterLab's own kernel status item ("Python 3 · GPU small | Idle") says nothing of
 * hibernation; while this extension's item shows the kernel, the stock one is hidden, so the
 * status bar shows one state. It is found by its text (the kernel's display name), since the
 * status bar gives its items no id.
 */
function hideStockKernelStatus(ours: HTMLElement, displayName: string | null): void {
  const siblings = Array.from(ours.parentElement?.children ?? []);
  for (const node of siblings) {
    if (node === ours) {
      continue;
    }
    const text = node.textContent ?? '';
    const stock = !!displayName && (text === displayName || text.startsWith(`${displayName} | `));
    node.classList.toggle('jp-ElasticStatus-replaced', stock);
  }
}

/** The status bar item; the status bar shows it only while `active` (a kernel with a GPU size). */
class StatusItem extends Widget {
  readonly activeChanged = new Signal<this, void>(this);
  active = false;

  constructor() {
    super();
    this.addClass('jp-ElasticStatus');
    this.node.title =
      "GPU size, GPU use and state of this notebook's kernel (jupyter-elastic-kernels); click to change its GPU size, keeping its variables";
  }

  show_(text: string | null, state: string): void {
    this.node.textContent = text ?? '';
    this.node.dataset.state = state;
    if (this.active !== (text !== null)) {
      this.active = text !== null;
      this.activeChanged.emit();
    }
  }
}

/** The launcher's GPU-size cards: ordered by size, a per-size icon, a short label (see launcherCss). */
async function styleLauncher(app: JupyterFrontEnd): Promise<void> {
  const reply = await serverFetch('api/elastic/profiles');
  if (reply.status !== 200) {
    return;
  }
  const { profiles, start_queue_wait } = (await reply.json()) as { profiles: Profile[]; start_queue_wait?: number };
  const specs = app.serviceManager.kernelspecs;
  await specs.ready;
  const render = (): void => {
    const known = specs.specs?.kernelspecs ?? {};
    let style = document.getElementById('jupyter-elastic-kernels-launcher');
    if (!style) {
      style = document.createElement('style');
      style.id = 'jupyter-elastic-kernels-launcher';
      document.head.appendChild(style);
    }
    style.textContent = launcherCss(profiles, name => known[name]?.display_name, (start_queue_wait ?? 0) > 0);
  };
  render();
  if (!launcherStyled) {
    launcherStyled = true;
    specs.specsChanged.connect(() => void styleLauncher(app));
  }
}
let launcherStyled = false;

/**
 * JupyterLab's "Select Kernel" dialog (also opened after a start was refused) says which GPU sizes
 * would not start at once, and does not preselect again a size that was just refused (see
 * pickerChoice). The dialog offers no hook: its options are found as it opens, by their values
 * (`{"name": <kernelspec>}`), and annotated with what the server says now.
 */
function annotateKernelPickers(): void {
  const annotate = async (select: HTMLSelectElement): Promise<void> => {
    const bySpec = new Map<string, HTMLOptionElement>();
    for (const option of Array.from(select.options)) {
      try {
        const choice = JSON.parse(option.value) as { name?: unknown; id?: unknown } | null;
        if (choice && typeof choice.name === 'string' && !choice.id) {
          bySpec.set(choice.name, option);
        }
      } catch {
        // not a kernelspec's option
      }
    }
    if (!bySpec.size) {
      return;
    }
    const reply = await serverFetch('api/elastic/profiles');
    if (reply.status !== 200) {
      return;
    }
    const { profiles, start_queue_wait } = (await reply.json()) as { profiles: Profile[]; start_queue_wait?: number };
    const selected = [...bySpec].find(([, option]) => option.selected)?.[0] ?? null;
    const { notes, select: instead } = pickerChoice([...bySpec.keys()], selected, profiles, (start_queue_wait ?? 0) > 0);
    for (const [spec, note] of Object.entries(notes)) {
      const option = bySpec.get(spec);
      if (option && !option.dataset.elasticNote) {
        option.dataset.elasticNote = note;
        option.text = `${option.text} — ${note}`;
      }
    }
    const replacement = instead ? bySpec.get(instead) : undefined;
    if (replacement) {
      replacement.selected = true;
    }
  };
  new MutationObserver(records => {
    for (const record of records) {
      for (const node of Array.from(record.addedNodes)) {
        if (node instanceof HTMLElement && node.classList.contains('jp-Dialog')) {
          node.querySelectorAll('select').forEach(select => void annotate(select));
        }
      }
    }
  }).observe(document.body, { childList: true });
}

/** The commands' ids (Kernel menu: schema/plugin.json; the command palette). */
const COMMANDS = {
  hibernate: 'elastic-kernels:hibernate',
  resume: 'elastic-kernels:resume',
  report: 'elastic-kernels:show-report',
  changeSize: 'elastic-kernels:change-size',
  showGpus: 'elastic-kernels:show-gpus'
};

/** What a command acts on: `args.kernelId`, the kernel right-clicked in the running-kernels
 * panel (its item's `data-context` is the kernel id), else the current notebook's. */
function targetKernelId(
  app: JupyterFrontEnd,
  args: { kernelId?: unknown },
  current: () => string | undefined
): string | undefined {
  if (typeof args.kernelId === 'string') {
    return args.kernelId;
  }
  const hit = app.contextMenuHitTest(
    node => node.classList.contains('jp-RunningSessions-item') && !!node.dataset.context
  );
  return hit?.dataset.context ?? current();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-elastic-kernels:plugin',
  description: 'GPU size, use, state, idle warnings and resume progress of elastic kernels.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ICommandPalette, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null
  ) => {
    let statusOptions: StatusOptions = { ...STATUS_DEFAULTS };
    const poller = new KernelPoller(serverFetch, 3000);
    const item = new StatusItem();
    const notified = new Map<string, string>(); // kernel id -> notification id
    let panel: GpusPanel | null = null;

    const currentKernelId = (): string | undefined =>
      tracker.currentWidget?.sessionContext.session?.kernel?.id;

    const notebookOf = (kernelId: string): string | undefined => {
      let found: string | undefined;
      tracker.forEach(nb => {
        if (nb.sessionContext.session?.kernel?.id === kernelId) {
          found = nb.context.path;
        }
      });
      return found;
    };

    const keepRunning = async (kernelId: string): Promise<void> => {
      const reply = await serverFetch(`api/elastic/kernels/${kernelId}/activity`, { method: 'POST' });
      if (reply.status !== 200) {
        const body = (await reply.json()) as { message?: string };
        Notification.error(`Could not keep the kernel running: ${body.message ?? reply.status}`);
      }
      await poller.refresh();
    };

    // The warning's time left counts down in the open notification, from the server's deadline and
    // the last poll's model: a local timer, no extra request. It stops when the warning is cleared,
    // or when the user closed the notification (update then finds nothing to change).
    const countdowns = new Map<string, number>();
    const stopCountdown = (kernelId: string): void => {
      window.clearInterval(countdowns.get(kernelId));
      countdowns.delete(kernelId);
    };
    const startCountdown = (kernelId: string, notificationId: string): void => {
      stopCountdown(kernelId);
      const tick = (): void => {
        const kernel = poller.kernels.get(kernelId);
        const message = kernel?.activity.warning ? warningText(kernel, Date.now() / 1000, notebookOf(kernelId)) : '';
        if (!message || !Notification.update({ id: notificationId, message })) {
          stopCountdown(kernelId);
        }
      };
      countdowns.set(kernelId, window.setInterval(tick, 1000));
    };

    const badges = new Map<NotebookPanel, ToolbarState>();
    /** One notification a kernel (hibernated by the policy, resumed): the next replaces it. */
    const kernelNotices = new Map<string, string>();
    const renderStatus = (): void => {
      const current = tracker.currentWidget;
      const id = currentKernelId();
      const kernel = id ? poller.kernels.get(id) : undefined;
      const shown = statusText(kernel, undefined, current?.sessionContext.kernelDisplayStatus, statusOptions);
      const text = shown && !poller.reachable ? UNREACHABLE : shown;
      item.show_(text, text === UNREACHABLE ? 'unreachable' : (kernel?.state ?? ''));
      hideStockKernelStatus(item.node, text ? (current?.sessionContext.kernelDisplayName ?? null) : null);
      for (const [panel, badge] of badges) {
        const kid = panel.sessionContext.session?.kernel?.id;
        const k = kid ? poller.kernels.get(kid) : undefined;
        const badgeText = toolbarText(k);
        badge.show_(badgeText && !poller.reachable ? UNREACHABLE : badgeText, k?.state ?? '');
        panel.node.dataset.elasticState = k?.profile ? k.state : '';
      }
    };

    /** A notebook whose kernel changed size gets a connection with the new kernelspec's name (same
     * kernel id, so JupyterLab would otherwise keep naming the old size in its toolbar). */
    const followKernelNames = (): void => {
      tracker.forEach(nb => {
        const session = nb.sessionContext.session;
        const kernel = session?.kernel;
        const name = kernel ? renamedKernel(kernel.name, poller.kernels.get(kernel.id)) : '';
        // `update` is the session connection's own (JupyterLab's session manager calls it), not
        // on its interface: dropping the kernel, then setting it again, makes a new connection.
        const connection = session as unknown as { update?: (model: unknown) => void } | null;
        if (!session || !kernel || !name || typeof connection?.update !== 'function') {
          return;
        }
        const model = session.model;
        connection.update({ ...model, kernel: null });
        connection.update({ ...model, kernel: { ...kernel.model, name } });
      });
    };
    /** While a resume of one of this page's kernels waits for a slice: a notification with its
     * place in the queue and Cancel (as the GPUs panel has), gone when the wait ends. */
    const waitNotices = new Map<string, string>();
    const showWaiting = (id: string, kernel: ElasticKernel | undefined): void => {
      const text = waitingText(kernel, notebookOf(id));
      const shown = waitNotices.get(id);
      if (!text || !notebookOf(id)) {
        if (shown) {
          Notification.dismiss(shown);
          waitNotices.delete(id);
        }
        return;
      }
      const actions = [
        {
          label: 'Cancel',
          caption: 'Stop waiting: the kernel stays hibernated, with its variables',
          callback: () => void cancelWait(id)
        }
      ];
      if (!shown || !Notification.update({ id: shown, message: text, actions })) {
        waitNotices.set(id, Notification.info(text, { autoClose: false, actions }));
      }
    };
    const cancelWait = async (id: string): Promise<void> => {
      const reply = await serverFetch(`api/elastic/kernels/${id}/cancel`, { method: 'POST' });
      if (reply.status !== 200) {
        const body = (await reply.json()) as { message?: string };
        Notification.error(`Could not stop waiting: ${body.message ?? reply.status}`);
      }
      await poller.refresh();
    };
    /** The size each kernel last ran at, to tell a resize's resume from any other. */
    const ranAt = new Map<string, string>();
    /** Kernels this page is resizing: their resume is announced when the request answers. */
    const resizing = new Set<string>();
    /** The resume's notification, with its restore report: one a kernel (it replaces the last). */
    const announceResume = (id: string, resizedTo?: string): void => {
      void serverFetch(`api/elastic/kernels/${id}/report`).then(async reply => {
        if (reply.status !== 200) {
          return;
        }
        const body = (await reply.json()) as { restore_report: unknown };
        const where = notebookOf(id);
        const report = body.restore_report as RestoreReport | null;
        const severity = reportSeverity(report);
        const last = kernelNotices.get(id);
        if (last) {
          Notification.dismiss(last);
        }
        const nid = Notification.emit(`${where ? where + ': ' : ''}${reportSummary(report, resizedTo)}`, severity, {
          autoClose: severity === 'success' ? 6000 : false,
          actions: [
            {
              label: 'Details',
              caption: 'What was restored, and what was not and why',
              callback: () => void showReport(where, report)
            }
          ]
        });
        kernelNotices.set(id, nid);
      });
    };

    poller.onUpdate((p, previous) => {
      followKernelNames();
      renderStatus();
      for (const command of Object.values(COMMANDS)) {
        app.commands.notifyCommandChanged(command); // enabled or not follows the kernel's state
      }
      const now = Date.now() / 1000;
      for (const id of new Set([...previous.keys(), ...p.kernels.keys()])) {
        const before = previous.get(id);
        const after: ElasticKernel | undefined = p.kernels.get(id);
        const change = changes(before, after);
        if (change.warned && after?.profile) {
          const text = warningText(after, now, notebookOf(id));
          const nid = Notification.warning(text, {
            autoClose: false,
            actions: [{ label: 'Keep running', caption: 'Counts as activity', callback: () => void keepRunning(id) }]
          });
          notified.set(id, nid);
          startCountdown(id, nid);
        } else if (change.warningCleared && notified.has(id)) {
          Notification.dismiss(notified.get(id));
          notified.delete(id);
          stopCountdown(id);
        }
        if (change.culled && after?.profile) {
          const last = kernelNotices.get(id);
          if (last) {
            Notification.dismiss(last);
          }
          kernelNotices.set(id, Notification.info(culledText(notebookOf(id)), { autoClose: CULLED_NOTICE_MS }));
        }
        showWaiting(id, after);
        const sizeBefore = ranAt.get(id);
        if (after?.state === 'running' && after.profile) {
          ranAt.set(id, after.profile);
        } else if (!after) {
          ranAt.delete(id);
        }
        if (change.resumed && after?.profile && !resizing.has(id)) {
          announceResume(id, sizeBefore && sizeBefore !== after.profile ? after.profile : undefined);
        }
      }
      panel?.update_();
    });

    // Commands on a kernel: the current notebook's (Kernel menu, command palette) or the one
    // right-clicked in the running-kernels panel (its context menu).
    const elasticKernel = (args: { kernelId?: unknown }): ElasticKernel | undefined => {
      const id = targetKernelId(app, args, currentKernelId);
      const kernel = id && poller.reachable ? poller.kernels.get(id) : undefined;
      return kernel?.profile ? kernel : undefined; // nothing to act on while the server is away
    };
    const act = async (kernel: ElasticKernel | undefined, action: 'hibernate' | 'resume'): Promise<void> => {
      if (!kernel) {
        return;
      }
      const reply = await serverFetch(`api/elastic/kernels/${kernel.id}/${action}`, { method: 'POST' });
      if (reply.status !== 200) {
        const body = (await reply.json()) as { message?: string };
        await showErrorMessage(`Could not ${action} the kernel`, body.message ?? `HTTP ${reply.status}`);
      }
      await poller.refresh();
    };
    /** Hibernate, then resume at the size the user picks (when it fits: the resume waits its turn). */
    const changeSize = async (kernel: ElasticKernel | undefined): Promise<void> => {
      if (!kernel) {
        return;
      }
      const profiles = await serverFetch('api/elastic/profiles');
      if (profiles.status !== 200) {
        return;
      }
      const choices = sizeChoices(((await profiles.json()) as { profiles: Profile[] }).profiles, kernel.profile);
      const where = notebookOf(kernel.id);
      if (!choices.length) {
        await showErrorMessage('No other GPU size', 'This server offers no other GPU size that fits its GPUs.');
        return;
      }
      const picked = await InputDialog.getItem({
        title: `Change GPU size${where ? ' · ' + where : ''} (now ${kernel.profile})`,
        label: 'The kernel is hibernated (its variables saved), then resumed at the new size:',
        items: choices.map(c => c.label),
        okLabel: 'Change size'
      });
      const size = choices.find(c => c.label === picked.value)?.name;
      if (!picked.button.accept || !size) {
        return;
      }
      resizing.add(kernel.id);
      try {
        const request = serverFetch(`api/elastic/kernels/${kernel.id}/resize`, {
          method: 'POST',
          body: JSON.stringify({ size })
        });
        void poller.refresh(); // hibernating, then resuming: the status and the panel follow
        const reply = await request;
        if (reply.status === 200) {
          announceResume(kernel.id, size);
        } else {
          const body = (await reply.json()) as { message?: string };
          await showErrorMessage(`Could not change the GPU size to ${size}`, body.message ?? `HTTP ${reply.status}`);
        }
        await poller.refresh();
      } finally {
        resizing.delete(kernel.id);
      }
    };
    app.commands.addCommand(COMMANDS.hibernate, {
      label: 'Hibernate Kernel (Save Variables, Free the GPU)',
      caption: "Checkpoint the kernel's variables, stop it and release its GPU slice; the next cell resumes it",
      isEnabled: args => elasticKernel(args)?.state === 'running',
      execute: args => act(elasticKernel(args), 'hibernate')
    });
    app.commands.addCommand(COMMANDS.resume, {
      label: 'Resume Kernel',
      caption: 'Bring the hibernated kernel back now, with its variables',
      isEnabled: args => elasticKernel(args)?.state === 'hibernated',
      execute: args => act(elasticKernel(args), 'resume')
    });
    app.commands.addCommand(COMMANDS.changeSize, {
      label: 'Change GPU Size…',
      caption: 'Hibernate the kernel, then resume it at another GPU size (its variables kept)',
      isEnabled: args => ['running', 'hibernated'].includes(elasticKernel(args)?.state ?? ''),
      execute: args => changeSize(elasticKernel(args))
    });
    app.commands.addCommand(COMMANDS.showGpus, {
      label: 'GPUs Panel',
      caption: 'Your kernels with their GPU sizes and states, and every GPU with its slices and use',
      isEnabled: () => panel !== null,
      execute: () => {
        if (panel) {
          app.shell.activateById(panel.id);
        }
      }
    });
    app.commands.addCommand(COMMANDS.report, {
      label: 'Show Restore Report',
      caption: "What the kernel's last resume restored, recomputed and could not restore, and why",
      isEnabled: args => elasticKernel(args) !== undefined,
      execute: async args => {
        const kernel = elasticKernel(args);
        if (!kernel) {
          return;
        }
        const reply = await serverFetch(`api/elastic/kernels/${kernel.id}/report`);
        if (reply.status === 200) {
          const body = (await reply.json()) as { restore_report: RestoreReport | null };
          await showReport(notebookOf(kernel.id), body.restore_report, !body.restore_report);
        }
      }
    });
    if (settingRegistry) {
      void settingRegistry.load(plugin.id).then(loaded => {
        const read = (): void => {
          statusOptions = {
            size: loaded.get('statusShowsSize').composite !== false,
            gpuUse: loaded.get('statusShowsGpuUse').composite !== false,
            idleTime: loaded.get('statusShowsIdleTime').composite !== false
          };
          renderStatus();
        };
        read();
        loaded.changed.connect(read);
      });
    }
    if (palette) {
      for (const command of Object.values(COMMANDS)) {
        palette.addItem({ command, category: 'Elastic Kernels' });
      }
    }

    tracker.currentChanged.connect(renderStatus);
    // A cell sent to a hibernated kernel starts its resume: look now rather than at the next poll
    // (only then: a running kernel's busy/idle changes cost nothing).
    const tellNotesShownHere = (notebook: NotebookPanel): void => {
      const kernel = notebook.sessionContext.session?.kernel;
      if (!kernel || kernel.connectionStatus !== 'connected' || !poller.available) {
        return; // a server without the server part would pass it on to the kernel
      }
      // A message type of this project's, not in the protocol's list of types.
      const create = KernelMessage.createMessage as (options: unknown) => KernelMessage.IControlMessage;
      const msg = create({ msgType: NOTES_SHOWN_REQUEST, channel: 'control', session: kernel.clientId, content: {} });
      kernel.sendControlMessage(msg, false, true).dispose(); // no reply comes
    };
    const watchNotebook = (notebook: NotebookPanel): void => {
      // Each connection (a new kernel, a reconnect to another gateway) is told, once the server is
      // known; also the one already open when the notebook joins the tracker. Told twice (a new
      // kernel that then connects) does no harm: the server only notes it.
      const tell = (): void =>
        void (poller.available === null ? poller.refresh() : Promise.resolve()).then(() =>
          tellNotesShownHere(notebook)
        );
      notebook.sessionContext.connectionStatusChanged.connect((_, status) => {
        if (status === 'connected') {
          tell();
        }
      });
      // A kernel connection can come in connected already (no status change is seen then).
      notebook.sessionContext.kernelChanged.connect(tell);
      tell();
      notebook.sessionContext.statusChanged.connect(() => {
        const id = notebook.sessionContext.session?.kernel?.id;
        const kernel = id ? poller.kernels.get(id) : undefined;
        if (kernel && kernel.state !== 'running' && poller.available) {
          void poller.refresh();
        }
        if (notebook === tracker.currentWidget) {
          renderStatus(); // busy / idle as JupyterLab sees it, at once
        }
      });
      const badge = new ToolbarState();
      badges.set(notebook, badge);
      notebook.disposed.connect(() => badges.delete(notebook));
      void notebook.revealed.then(() => {
        if (!notebook.toolbar.insertAfter('kernelName', 'elasticState', badge)) {
          notebook.toolbar.addItem('elasticState', badge);
        }
        renderStatus();
      });
    };
    // Also the notebooks opened before this plugin activated (a page load restores them early).
    tracker.forEach(watchNotebook);
    tracker.widgetAdded.connect((_, notebook) => watchNotebook(notebook));
    // "Change GPU Size…" keeps the variables; JupyterLab's kernel picker would start a new kernel
    // and shut this one down without a word.
    item.node.onclick = () => {
      if (app.commands.isEnabled(COMMANDS.changeSize)) {
        void app.commands.execute(COMMANDS.changeSize);
      }
    };
    if (statusBar) {
      statusBar.registerStatusItem('jupyter-elastic-kernels:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => item.active,
        activeStateChanged: item.activeChanged
      });
    }
    void poller.poll().then(() => {
      if (poller.available !== true) {
        return; // no /api/elastic here: nothing appears
      }
      void styleLauncher(app);
      annotateKernelPickers();
      // Which sizes fit now changes as kernels take and free slices: the cards follow.
      let slices = '';
      poller.onUpdate(p => {
        const now = [...p.kernels.values()].map(k => `${k.id}:${k.state}:${k.profile}`).join(',');
        if (now !== slices) {
          slices = now;
          void styleLauncher(app);
        }
      });
      panel = new GpusPanel(poller, serverFetch, notebookOf, kernelId =>
        void app.commands.execute(COMMANDS.changeSize, { kernelId })
      );
      app.shell.add(panel, 'left', { rank: 700 });
      app.commands.notifyCommandChanged(COMMANDS.showGpus);
      poller.start();
    });
  }
};

export default plugin;
