; Flotilla for Windows: Inno Setup 6 script -> Flotilla-<version>-Setup.exe
;
; Built by .github/workflows/installers.yml on a hosted Windows runner:
;   python -m installers.build --bundle-only          (PyInstaller bundle, icons)
;   iscc /DAppVersion=<pyproject version> /DNumericVersion=<x.y.z> ^
;        /DBundleDir=<...\bundle\flotilla> /DIconFile=<...\flotilla.ico> ^
;        /DOutputDir=dist installers\windows\flotilla.iss
; The version is never written here: CI reads it from pyproject.toml
; (python -m installers.project version) and passes it in.
;
; What it installs: the one-folder bundle in Program Files\Flotilla, Start-menu
; entries (Flotilla, Flotilla Agent), optionally a desktop icon, optionally the
; agent at every login (all users), Windows Firewall rules for the agent and the
; app on private/domain networks (mDNS UDP 5353, the agent's TCP 47600-47602 and
; the shard workers' data-plane ports). Uninstall removes all of it, and asks,
; one folder at a time, whether to remove the user's chat history, pairing keys,
; settings, shards and model cache too (each answer removes exactly that folder).

#ifndef AppVersion
  #error Pass /DAppVersion=... (from pyproject.toml: python -m installers.project version)
#endif
#ifndef NumericVersion
  #define NumericVersion AppVersion
#endif
#ifndef BundleDir
  #define BundleDir "..\..\build\bundle\flotilla"
#endif
#ifndef IconFile
  #define IconFile "..\..\build\icons\flotilla.ico"
#endif
#ifndef OutputDir
  #define OutputDir "..\..\dist"
#endif

#define AppName "Flotilla"
#define AppExe "FlotillaApp.exe"
#define CliExe "flotilla.exe"
#define AgentExe "flotilla-agent.exe"
; = installers/project.py AGENT_TCP_PORTS and MDNS_UDP_PORT (a test checks they agree)
#define AgentPorts "47600-47602"
#define MdnsPort "5353"
; = installers/autostart.py WIN_RUN_VALUE
#define RunValue "FlotillaAgent"
; The user's folders under %LOCALAPPDATA%\flotilla, = engine/paths.py (KINDS) and the model
; cache (platformdirs' user cache folder, engine/models/demo.py); a test checks they agree.
#define UserRoot "{localappdata}\flotilla"
#define HistoryDir "history"
#define KeysDir "keys"
#define SettingsDir "settings"
#define DataDir "data"
#define CacheDir "Cache"

[Setup]
AppId={{6C1B2F5E-3A57-4F0D-9E51-8D7A4C2B9F31}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=Flotilla developers
VersionInfoVersion={#NumericVersion}
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
; Firewall rules and Program Files need an administrator.
PrivilegesRequired=admin
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputDir={#OutputDir}
OutputBaseFilename=Flotilla-{#AppVersion}-Setup
SetupIconFile={#IconFile}
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName={#AppName}
Compression=lzma2/max
SolidCompression=yes
LZMANumBlockThreads=4
WizardStyle=modern
; Stop a running app/agent before files are replaced or removed (Restart Manager).
CloseApplications=force
RestartApplications=no

[Languages]
Name: "en"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "Create a desktop icon"; Flags: unchecked
Name: "agentautostart"; Description: "Start the Flotilla agent at every login (lends this PC to your fleet while it is idle; any user of this PC)"; Flags: unchecked
Name: "firewall"; Description: "Allow Flotilla through Windows Firewall on private and domain networks (needed to find and use other PCs)"

[Files]
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{app}"
Name: "{autoprograms}\Flotilla Agent"; Filename: "{app}\{#AgentExe}"; WorkingDir: "{app}"; Comment: "Lend this PC to your Flotilla fleet while you are away"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{app}"; Tasks: desktopicon

[Registry]
; Machine-wide autostart chosen in Setup (HKLM). The app's own opt-in writes
; the same value name under HKCU (installers/autostart.py).
Root: HKLM; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: string; ValueName: "{#RunValue}"; ValueData: """{app}\{#AgentExe}"""; Flags: uninsdeletevalue; Tasks: agentautostart

[Run]
; Program-scoped rules: the agent's control/pairing/info ports, the shard
; workers' data-plane ports (workers run as flotilla-agent.exe) and mDNS.
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla agent (TCP)"" dir=in action=allow profile=private,domain protocol=TCP program=""{app}\{#AgentExe}"""; Flags: runhidden; Tasks: firewall; StatusMsg: "Adding firewall rules..."
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla agent (mDNS)"" dir=in action=allow profile=private,domain protocol=UDP localport={#MdnsPort} program=""{app}\{#AgentExe}"""; Flags: runhidden; Tasks: firewall
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla app (TCP)"" dir=in action=allow profile=private,domain protocol=TCP program=""{app}\{#AppExe}"""; Flags: runhidden; Tasks: firewall
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla app (mDNS)"" dir=in action=allow profile=private,domain protocol=UDP localport={#MdnsPort} program=""{app}\{#AppExe}"""; Flags: runhidden; Tasks: firewall
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla CLI (TCP)"" dir=in action=allow profile=private,domain protocol=TCP program=""{app}\{#CliExe}"""; Flags: runhidden; Tasks: firewall
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla CLI (mDNS)"" dir=in action=allow profile=private,domain protocol=UDP localport={#MdnsPort} program=""{app}\{#CliExe}"""; Flags: runhidden; Tasks: firewall
; The agent's fixed ports, for IT tools that audit by port (47600 control, 47601 pairing, 47602 info).
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall add rule name=""Flotilla agent ports"" dir=in action=allow profile=private,domain protocol=TCP localport={#AgentPorts} program=""{app}\{#AgentExe}"""; Flags: runhidden; Tasks: firewall
Filename: "{app}\{#AppExe}"; Description: "Open Flotilla now"; Flags: nowait postinstall skipifsilent
Filename: "{app}\{#AgentExe}"; Description: "Start the Flotilla agent now"; Flags: nowait postinstall skipifsilent unchecked runasoriginaluser; Tasks: agentautostart

[UninstallRun]
Filename: "{sys}\taskkill.exe"; Parameters: "/F /T /IM {#AgentExe}"; Flags: runhidden; RunOnceId: "StopAgent"
Filename: "{sys}\taskkill.exe"; Parameters: "/F /T /IM {#AppExe}"; Flags: runhidden; RunOnceId: "StopApp"
; Earlier versions kept every file flat in {#UserRoot}: move them into their folders first, so
; that each question below covers them (python -m engine.paths migrate; never deletes a file).
Filename: "{app}\{#CliExe}"; Parameters: "-m engine.paths migrate"; Flags: runhidden; RunOnceId: "MigrateFolders"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla agent (TCP)"""; Flags: runhidden; RunOnceId: "FwAgentTcp"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla agent (mDNS)"""; Flags: runhidden; RunOnceId: "FwAgentMdns"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla app (TCP)"""; Flags: runhidden; RunOnceId: "FwAppTcp"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla app (mDNS)"""; Flags: runhidden; RunOnceId: "FwAppMdns"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla CLI (TCP)"""; Flags: runhidden; RunOnceId: "FwCliTcp"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla CLI (mDNS)"""; Flags: runhidden; RunOnceId: "FwCliMdns"
Filename: "{sys}\netsh.exe"; Parameters: "advfirewall firewall delete rule name=""Flotilla agent ports"""; Flags: runhidden; RunOnceId: "FwAgentPorts"

[UninstallDelete]
; Anything the bundle wrote next to itself (nothing expected; belt and braces).
Type: filesandordirs; Name: "{app}"

[Code]
// Uninstall: the per-user autostart the app may have set, then one question per folder of the
// user's (engine/paths.py): each "yes" removes exactly that folder and nothing else, so keeping
// the chat history while removing the settings (or the other way round) works. The root goes
// only once it is empty. A silent uninstall removes none of them.
procedure RemoveIfWanted(const Question, Sub: String);
var
  Folder: String;
begin
  Folder := ExpandConstant('{#UserRoot}\' + Sub);
  if DirExists(Folder) then
    if MsgBox(Question + #13#10#13#10 + Folder, mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES then
      DelTree(Folder, True, True, True);
end;

procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
begin
  if CurUninstallStep = usPostUninstall then
  begin
    RegDeleteValue(HKEY_CURRENT_USER, 'Software\Microsoft\Windows\CurrentVersion\Run', '{#RunValue}');
    if not UninstallSilent then
    begin
      RemoveIfWanted('Also remove your Flotilla chat history?', '{#HistoryDir}');
      RemoveIfWanted('Also remove this PC''s Flotilla pairing keys and sharing policy? ' +
                     'PCs paired with it would have to pair again.', '{#KeysDir}');
      RemoveIfWanted('Also remove your Flotilla app settings?', '{#SettingsDir}');
      RemoveIfWanted('Also remove the shards and logs this PC kept for the fleet?', '{#DataDir}');
      RemoveIfWanted('Also remove downloaded and exported models (the model cache)?', '{#CacheDir}');
      RemoveDir(ExpandConstant('{#UserRoot}'));  // only succeeds when nothing is left in it
    end;
  end;
end;
